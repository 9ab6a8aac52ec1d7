"""Speculative decoding tests: engines built with and without a proposer over the same checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # _engine_util


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    yield
