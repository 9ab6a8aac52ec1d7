"""Fixtures of the structured-output tests: a float32 CPU ``LLM`` over the tiny random llama checkpoint (byte-level
vocabulary: every JSON character is one token, and nothing but the constraint makes its output valid)."""

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


@pytest.fixture(scope="session")
def tiny(hf_checkpoint) -> LLM:
    return LLM(model=str(hf_checkpoint("llama")), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_pool(hf_checkpoint) -> LLM:
    """The same model with a KV cache too small for a batch: requests are preempted and recomputed."""
    return LLM(model=str(hf_checkpoint("llama")), dtype="float32", device="cpu", block_size=4, num_blocks=24)

