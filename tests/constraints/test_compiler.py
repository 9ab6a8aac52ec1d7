"""ConstraintCompiler: size limits, the LRU cache, timeouts remembered, and busy compile threads said as a 503."""

from __future__ import annotations

import threading

import pytest

from litellm_pipeline import registry
from litellm_pipeline.constraints import ConstraintCompiler, ConstraintSettings, to_constraint
from litellm_pipeline.errors import InvalidRequestError, OverloadedError
from litellm_pipeline.text.tokenizer import build_byte_tokenizer


def _grammars():
    from litellm_pipeline.constraints.grammar import Grammars

    tok = build_byte_tokenizer()
    return Grammars(tok, tok.vocab_size, [1])


class Blocking:
    """A kind whose compile waits for the test: a compile that takes as long as the test wants."""

    release = threading.Event()

    def __init__(self, grammars):
        self.grammars = grammars

    def compile(self, value):
        assert Blocking.release.wait(30)
        return self.grammars.regex(value)


@pytest.fixture
def blocking():
    Blocking.release = threading.Event()
    registry.add("constraint", "blocking", Blocking)
    yield
    Blocking.release.set()
    registry.remove("constraint", "blocking")


def test_size_limit_and_cache():
    c = ConstraintCompiler(_grammars, ConstraintSettings(max_spec_bytes=100, cache_entries=2))
    with pytest.raises(InvalidRequestError, match=r"constraint.choice: is \d+ bytes of JSON; at most 100"):
        c.compile(to_constraint({"choice": ["x" * 60, "y" * 60]}))
    a, b, d = (to_constraint({"regex": r}) for r in ("a", "b", "d"))
    first = c.compile(a)
    assert c.compile(a) is first and c.compiles == 1
    c.compile(b)
    c.compile(d)  # evicts a, the least recently used
    assert c.compile(b) is not None and c.compiles == 3
    assert c.compile(a) is not first and c.compiles == 4


def test_timeouts_are_remembered_and_busy_threads_give_a_503(blocking):
    c = ConstraintCompiler(_grammars, ConstraintSettings(compile_timeout_s=0.2, compile_threads=1))
    slow = to_constraint({"blocking": "[a-z]"})
    with pytest.raises(InvalidRequestError, match="constraint.blocking: took longer than 0.2 s to compile"):
        c.compile(slow)
    with pytest.raises(InvalidRequestError, match="took longer"):  # at once: the spec is remembered
        c.compile(slow)
    # the one compile thread is still busy with it: another spec waits its timeout, then is told to retry
    with pytest.raises(OverloadedError, match="compile thread is busy"):
        c.compile(to_constraint({"regex": "[0-9]"}))
    Blocking.release.set()
    c._pool.submit(lambda _: None, None).result(timeout=10)  # the stuck compile has ended
    assert c.compile(to_constraint({"regex": "[0-9]"})) is not None
