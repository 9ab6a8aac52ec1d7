"""Fixtures of the engine tests: cached float32 CPU ``LLM`` instances over tiny random checkpoints.

Every test runs with one torch thread (the tiny models gain nothing from more, and a shared 2-core machine
makes OpenMP spin-waits very slow) and, after it, anything a failed test left in flight is aborted so the
next test starts from an empty engine.
"""

from __future__ import annotations

import pytest
import torch

from litellm_pipeline import LLM


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class NoProgress(AssertionError):
    """The engine kept stepping without scheduling anything: a caller is spinning forever."""


MAX_EMPTY_STEPS = 1000


def _add_watchdog(scheduler) -> None:
    """Make a stuck engine fail the test instead of hanging it: after MAX_EMPTY_STEPS consecutive steps
    that schedule nothing (a deadlocked queue, or a caller waiting for output that will never come),
    ``step()`` raises :class:`NoProgress`."""
    original = scheduler.schedule
    empty = [0]

    def schedule():
        plan = original()
        empty[0] = 0 if plan else empty[0] + 1
        if empty[0] >= MAX_EMPTY_STEPS:
            empty[0] = 0
            state = "requests wait but none can be scheduled" if scheduler.has_unfinished() else "nothing is in flight"
            raise NoProgress(f"{MAX_EMPTY_STEPS} engine steps in a row scheduled nothing ({state})")
        return plan

    scheduler.schedule = schedule


class LLMCache:
    """``make(arch="llama", ckpt=None, **config)``: one LLM per (checkpoint, config), built on first use."""

    def __init__(self, hf_checkpoint):
        self._hf_checkpoint = hf_checkpoint
        self._llms: dict[tuple, LLM] = {}

    def __call__(self, arch: str = "llama", ckpt=None, **config) -> LLM:
        path = str(ckpt if ckpt is not None else self._hf_checkpoint(arch))
        key = (path, tuple(sorted((k, repr(v)) for k, v in config.items())))
        if key not in self._llms:
            llm = LLM(model=path, dtype="float32", device="cpu", **config)
            _add_watchdog(llm.engine.rt.scheduler)
            self._llms[key] = llm
        return self._llms[key]

    def abort_leftovers(self) -> None:
        for llm in self._llms.values():
            for rid in list(llm.engine.requests):
                llm.engine.abort(rid)


@pytest.fixture(scope="session")
def make_llm(hf_checkpoint):
    return LLMCache(hf_checkpoint)


@pytest.fixture(autouse=True)
def _abort_leftovers(request):
    yield
    if "make_llm" in request.fixturenames:
        request.getfixturevalue("make_llm").abort_leftovers()


@pytest.fixture
def llama(make_llm) -> LLM:
    """Default settings: a cache big enough for everything, a 2048-token step budget."""
    return make_llm("llama")
