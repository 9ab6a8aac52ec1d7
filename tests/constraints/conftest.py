"""Fixtures of the structured-output tests: a float32 CPU ``LLM`` over the tiny random llama checkpoint (byte-level
vocabulary: every JSON character is one token, and nothing but the constraint makes its output valid)."""

from __future__ import annotations

import pytest

from litellm_pipeline import LLM


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread (tests/conftest.py): the tiny model gains nothing from more on a shared machine."""


@pytest.fixture(scope="session")
def tiny(hf_checkpoint) -> LLM:
    return LLM(model=str(hf_checkpoint("llama")), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_pool(hf_checkpoint) -> LLM:
    """The same model with a KV cache too small for a batch: requests are preempted and recomputed."""
    return LLM(model=str(hf_checkpoint("llama")), dtype="float32", device="cpu", block_size=4, num_blocks=24)

