"""Speculative decoding tests: engines built with and without a proposer over the same checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # _engine_util


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    yield


@pytest.fixture
def steady_steps(monkeypatch):
    """Engine steps timed by a steady clock instead of the machine's: a step of n requests verifying d drafted
    rows takes ``(n + row_cost * d)`` ms, plus what the proposer really took (a shared machine's noise would
    otherwise decide how much is drafted). Returns a setter for ``row_cost`` (default 0.25)."""
    from litellm_pipeline.speculative.speculator import Speculator

    cost = {"row": 0.25}
    observe = Speculator.observe

    def steady(self, n, seconds):
        observe(self, n, 1e-3 * (n + cost["row"] * self._drafted) + self._draft_s)

    monkeypatch.setattr(Speculator, "observe", steady)
    return lambda row: cost.__setitem__("row", row)
