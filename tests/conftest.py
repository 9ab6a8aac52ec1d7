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


def pytest_terminal_summary(terminalreporter):
    """Which CPU kernel paths this session ran: the native build's (where it was loaded) and each build of
    tests/model/test_kernel_builds.py, with the reason for any this CPU could not run."""
    from litellm_pipeline.model import cpu_kernels

    lines = []
    ns = cpu_kernels.loaded()
    if ns is not None:
        lines.append(f"{cpu_kernels.isa()} build: vector kernels {ns.simd_isa()}, bfloat16 row_linear "
                     f"{ns.row_linear_path()}, native bf16/fp16 products {ns.native_bf16_gemm()}/{ns.native_fp16_gemm()}")
    mark = "test_kernel_tests_pass_on_every_build_this_cpu_runs["
    for outcome in ("passed", "failed", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            if mark not in rep.nodeid or (rep.when != "call" and outcome != "skipped"):
                continue
            isa = rep.nodeid.split(mark, 1)[1].rstrip("]")
            why = f": {rep.longrepr[2]}" if outcome == "skipped" and isinstance(rep.longrepr, tuple) else ""
            lines.append(f"{cpu_kernels.ISA_ENV}={isa} {outcome}{why}")
    if lines:
        terminalreporter.write_sep("-", "CPU kernel paths tested")
        for line in lines:
            terminalreporter.write_line(line)
