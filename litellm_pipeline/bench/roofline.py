"""This machine's roofline, measured: memory read bandwidth and GEMM FLOP/s (best of N each).

Best-of-N because the question is what the hardware can do; a noisy neighbour only ever makes a run slower.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """Shortest wall time of ``fn()`` over ``repeats`` runs, after one untimed run."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def read_bandwidth(mb: int = 1024, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes/s of a full reduction (``x.sum()``) over an ``mb``-MiB float32 tensor."""
    device = torch.device(device)
    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32, device=device)  # ones, not empty: pages are touched
    with torch.inference_mode():
        t = best_time(lambda: x.sum(), repeats, device)
    return x.numel() * x.element_size() / t


def last_level_cache_mb() -> float | None:
    """The largest CPU cache this machine reports (sysfs), MiB; None where it says nothing."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        units = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
        try:
            sizes.append(float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text) / 2**20)
        except (ValueError, IndexError):
            continue
    return max(sizes) if sizes else None


def stream_mb(mb: int) -> int:
    """The probe's buffer: at least ``mb`` MiB, 4x the last-level cache and 1 GiB, so that no level of cache serves
    it (a virtual machine may report less cache than it has: on a 2-core AMD EPYC guest that reports 32 MiB, 128 MiB
    still read at 118 GB/s and 512 MiB or more at 80-83)."""
    llc = last_level_cache_mb() or 0
    return max(mb, int(4 * llc), 1024)


def stream_bandwidth(mb: int = 1024, repeats: int = 5) -> float | None:
    """Bytes/s of the C++ kernels streaming an ``mb``-MiB float32 buffer with every decode thread, each its contiguous
    share as decode reads a weight matrix (``stream_read`` in csrc/layer_ops.cpp): the bandwidth decode can reach.
    None where the kernels cannot be built."""
    try:
        from litellm_pipeline.model import cpu_kernels

        run = cpu_kernels.ops().stream_read
    except Exception:
        return None
    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    t = best_time(lambda: run(x), repeats)
    return x.numel() * x.element_size() / t


def gemv_bandwidth(mb: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> float:
    """Bytes/s of a matrix-vector product over an ``mb``-MiB square matrix: the shape of batch-1 decode."""
    device = torch.device(device)
    n = max(16, int((mb * 2**20 / torch.finfo(dtype).bits * 8) ** 0.5))
    a = torch.full((n, n), 0.5, dtype=dtype, device=device)
    v = torch.full((n,), 0.5, dtype=dtype, device=device)
    with torch.inference_mode():
        t = best_time(lambda: torch.mv(a, v), repeats, device)
    return a.numel() * a.element_size() / t


def gemm_flops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul (2 n^3 FLOPs)."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    with torch.inference_mode():
        t = best_time(lambda: a @ b, repeats, device)
    return 2.0 * n**3 / t


def measure_roofline(dtypes: list[str], mb: int, gemm_size: int, repeats: int,
                     device: str | torch.device = "cpu") -> dict:
    """``{bandwidth_gbs: {sum, gemv_<dtype>..., best}, gemm_gflops: {<dtype>: ...}}``.

    ``best`` (the bandwidth the roofline uses) is the highest of the float32 reduction, the float32 GEMV and, on a
    CPU, ``stream``: the kernels' own threads streaming a buffer 4x the last-level cache (``stream_mb``), which is
    what decode sees (torch's ``sum`` and ``mv`` can fall well short of it: on a 2-core AMD EPYC they read 30 GB/s
    where decode streamed its weights at 60). A dtype whose GEMV kernel cannot keep up with memory is the kernel's
    fault, not the roofline's.
    """
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    bw = {"sum": read_bandwidth(mb, repeats, device) / 1e9}
    for name in dict.fromkeys(["float32", *dtypes]):
        bw[f"gemv_{name}"] = gemv_bandwidth(mb, repeats, dt[name], device) / 1e9
    probes = [bw["sum"], bw["gemv_float32"]]
    if torch.device(device).type == "cpu":
        big = stream_mb(mb)
        got = stream_bandwidth(big, repeats)
        if got is not None:
            bw["stream"] = got / 1e9
            bw["stream_mb"] = big
            probes.append(bw["stream"])
    bw["best"] = max(probes)
    flops = {name: gemm_flops(gemm_size, repeats, dt[name], device) / 1e9 for name in dict.fromkeys(dtypes)}
    return {"bandwidth_gbs": bw, "gemm_gflops": flops, "bandwidth_mb": mb, "gemm_size": gemm_size,
            "repeats": repeats, "device": str(device)}
