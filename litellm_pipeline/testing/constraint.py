"""check_constraint: a ``constraint`` kind compiled and walked token by token over a byte-level vocabulary.

The contract (``litellm_pipeline/registry/interfaces.py``: ``Constraint``, ``CompiledConstraint``, ``Matcher``): a
class built as ``cls(grammars)`` whose ``compile(value)`` returns an object whose ``matcher()`` starts a request's
output. What must hold for every kind, on each value given:

* ``compile`` of a bad value raises ``ValueError`` (the engine turns it into a 400 naming the kind);
* a matcher writes its whole bitmask row (the same row twice, whatever the row held before), allows some first
  token, accepts every token its mask allows and refuses every other one without moving;
* following allowed tokens (random walks, seeded) reaches an end-of-sequence token within ``max_tokens``, after
  which the matcher is terminated; ``rollback(k)`` gives back the mask it had ``k`` tokens earlier;
* matchers of one compiled constraint are independent (the engine shares the compiled object between requests);
* the demo engine runs a request with the constraint next to a free one, both finish, the KV pool is whole again.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from litellm_pipeline.testing._support import assert_drained, build_llm, config_name, describe, resolve

EOS = 1  # </s> of the byte-level tokenizer


def _grammars():
    from litellm_pipeline.constraints.grammar import Grammars
    from litellm_pipeline.text.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    return Grammars(tok, tok.vocab_size, [EOS])


def _allowed(matcher: Any, vocab: int, what: str, garbage: int = 0) -> list[int]:
    from litellm_pipeline.constraints.grammar import bitmask_words

    rows = []
    for fill in (garbage, -1):
        bm = torch.full((3, bitmask_words(vocab)), fill, dtype=torch.int32)
        matcher.fill_bitmask(bm, 1)
        rows.append(bm[1].clone())
    assert torch.equal(rows[0], rows[1]), f"{what}: fill_bitmask left part of its row as it was (it must write all)"
    bits = rows[0]
    return [t for t in range(vocab) if (int(bits[t // 32]) >> (t % 32)) & 1]


def _walk(compiled: Any, vocab: int, seed: int, max_tokens: int, what: str) -> list[int]:
    rng = random.Random(seed)
    m = compiled.matcher()
    taken: list[int] = []
    masks: list[list[int]] = []
    while True:
        allowed = _allowed(m, vocab, what)
        assert allowed, f"{what}: the mask allows no token after {taken}"
        masks.append(allowed)
        banned = sorted(set(range(vocab)) - set(allowed))
        if banned:
            t = rng.choice(banned)
            assert not m.accept(t), f"{what}: accept({t}) returned True but the mask does not allow it (after {taken})"
            assert _allowed(m, vocab, what) == allowed, f"{what}: a refused accept({t}) changed the matcher's state"
        t = EOS if EOS in allowed and (rng.random() < 0.5 or len(taken) > max_tokens // 2) else rng.choice(allowed)
        assert m.accept(t), f"{what}: accept({t}) returned False but the mask allows it (after {taken})"
        taken.append(t)
        if t == EOS:
            assert m.is_terminated(), f"{what}: the matcher is not terminated after accepting end-of-sequence"
            break
        assert not m.is_terminated(), f"{what}: terminated before an end-of-sequence token (after {taken})"
        assert len(taken) < max_tokens, f"{what}: no end-of-sequence token was allowed within {max_tokens} tokens"
    k = min(len(taken) - 1, 3)
    if k > 0:
        m.rollback(k)
        assert _allowed(m, vocab, what) == masks[-k], f"{what}: rollback({k}) did not restore the earlier mask"
    return taken


def check_constraint(impl: str | type, values: Sequence[Any], bad_values: Sequence[Any] = (), *,
                     max_tokens: int = 200, walks: int = 4) -> None:
    """Check a ``constraint`` class (a registry name or the class) on ``values`` it must compile and
    ``bad_values`` it must refuse. Raises ``AssertionError`` naming the case."""
    assert values, "check_constraint needs at least one value the kind compiles"
    cls = resolve("constraint", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    grammars = _grammars()
    kind = cls(grammars)
    vocab = grammars.vocab_size
    for bad in bad_values:
        try:
            kind.compile(bad)
        except ValueError:
            continue
        raise AssertionError(f"constraint {name}: compile({bad!r}) did not raise ValueError")
    for value in values:
        what = f"constraint {name} on {value!r}"
        compiled = kind.compile(value)
        paths = [_walk(compiled, vocab, seed, max_tokens, what) for seed in range(walks)]
        a, b = compiled.matcher(), compiled.matcher()
        first = paths[0][0]
        assert a.accept(first), f"{what}: a second matcher refused the first token of the first walk"
        assert _allowed(b, vocab, what) == _allowed(compiled.matcher(), vocab, what), (
            f"{what}: advancing one matcher changed another of the same compiled constraint")
    _check_engine(impl, name, values[0])


def _check_engine(impl: Any, name: str, value: Any) -> None:
    from litellm_pipeline.errors import InvalidRequestError
    from litellm_pipeline.sampling import SamplingParams

    llm = build_llm()
    with config_name("constraint", impl) as reg_name:
        params = SamplingParams(max_tokens=24, temperature=0.8, seed=1)
        try:
            outs = llm.generate(["12+345=", "copy:abc="], params, constraint={reg_name: value})
        except InvalidRequestError as exc:
            # the demo vocabulary (digits, lowercase letters, +=:,;? and space) cannot start this value's output
            assert "allows no token" in str(exc), f"constraint {name}: the demo engine refused {value!r}: {exc}"
            outs = []
        free = llm.generate(["12+345="], SamplingParams(max_tokens=4, temperature=0))
        assert all(o.finished and o.finish_reason in ("stop", "length") for o in [*outs, *free]), (
            f"constraint {name}: requests ended with {[o.finish_reason for o in outs]} ({[o.error for o in outs]})")
    assert_drained(llm, f"constraint {name}")
