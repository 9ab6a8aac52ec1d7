"""Shared test setup: ``tests/`` on sys.path (for ``from hf_models import ...``) and fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels run in the interpreter on CPU
# tensors (set before anything imports triton; a GPU machine runs them compiled)
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory ``hf_checkpoint(arch, seed=0, **overrides) -> Path`` of a tiny HF checkpoint
    (see ``tests/hf_models.py``), built once per (arch, seed, overrides) per session."""
    pytest.importorskip("transformers")
    from hf_models import save_checkpoint

    cache: dict[tuple, Path] = {}

    def make(arch: str, seed: int = 0, **overrides) -> Path:
        key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            name = f"{arch}-s{seed}" + (f"-v{len(cache)}" if overrides else "")
            cache[key] = save_checkpoint(arch, tmp_path_factory.mktemp(name), seed=seed, **overrides)
        return cache[key]

    return make


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
