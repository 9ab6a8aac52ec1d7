"""The randomized fault suite: a fixed-seed slice must find nothing, and it must find planted bugs."""

from __future__ import annotations

import pytest

from litellm_pipeline.engine.scheduler import FcfsScheduler
from litellm_pipeline.tasks.faults import FaultSettings, run_fault_suite

SLICE = FaultSettings(seed=0, runs=8, ops=60, progress=False)


def test_fixed_seed_slice_keeps_every_invariant():
    r = run_fault_suite(SLICE)
    assert r["failures"] == []
    # and it exercised what it is for
    assert r["admitted"] > 100 and r["invalid"] > 20 and r["aborted"] > 10 and r["faulted"] > 10
    assert r["preemptions"] > 0 and r["session_turns"] > 0


def test_it_catches_a_leaked_block(monkeypatch):
    original = FcfsScheduler.finish

    def leaky_finish(self, req):
        if req.finish_reason == "abort":
            req.block_ids = req.block_ids[1:]  # one block is forgotten
        original(self, req)

    monkeypatch.setattr(FcfsScheduler, "finish", leaky_finish)
    failures = run_fault_suite(FaultSettings(seed=0, runs=3, ops=60, progress=False))["failures"]
    assert any("KV pool not empty" in f for f in failures)


def test_it_catches_a_batch_poisoned_by_one_request(monkeypatch):
    from litellm_pipeline.engine.engine import Engine

    def fail_everyone(self, schedule, exc):  # the old behaviour: one bad request takes its whole step down
        return [self._fail(req, exc) for req, _ in schedule]

    monkeypatch.setattr(Engine, "_isolate", fail_everyone)
    failures = run_fault_suite(FaultSettings(seed=0, runs=4, ops=60, progress=False))["failures"]
    assert any("(not faulted) failed" in f for f in failures)


def test_it_catches_tokens_that_depend_on_the_batch(monkeypatch):
    from litellm_pipeline.engine.engine import Engine

    original = Engine._postprocess

    def skewed(self, ctx):  # the first request of a step with 3+ samples gets another token
        if len(ctx.samples) > 2:
            r, t, lp = ctx.samples[0]
            ctx.samples = [(r, 3 + (t + 1 - 3) % 40, lp), *ctx.samples[1:]]
        return original(self, ctx)

    monkeypatch.setattr(Engine, "_postprocess", skewed)
    failures = run_fault_suite(FaultSettings(seed=0, runs=4, ops=60, progress=False))["failures"]
    assert any("differ from alone" in f for f in failures)


@pytest.mark.parametrize("bad", [{"runs": 0}, {"ops": -1}, {"nonsense": 1}])
def test_bad_settings_name_the_key(bad):
    from litellm_pipeline.errors import ConfigError
    from litellm_pipeline.tasks.faults import fault_settings

    with pytest.raises(ConfigError, match="faults."):
        fault_settings(bad)
