"""A CPU model's weights in one region backed by transparent huge pages (``device.huge_pages``).

Batch-1 decode streams every weight from DRAM once per token. In 4 KiB pages that is one TLB miss per 4 KiB
read, and the hardware prefetchers stop at each page boundary; in 2 MiB pages both go away. torch's CPU
allocator asks for huge pages only under ``THP_MEM_ALLOC_ENABLE=1``, read once per process at its first
allocation, which a library cannot rely on. So once the weights are final (after the layer ops converted them,
see ``CausalLM.bind``), :func:`pack_weights` copies every CPU parameter into one anonymous mapping advised with
``MADV_HUGEPAGE`` and points the parameters at it (``p.data``: the Parameter objects stay the same). Values are
copied bit for bit, so results do not change; the old storage is freed as each parameter moves.

Measured on a 2-core AMD EPYC (AVX2), llama125m batch-1 decode, engine only, quiet machine, one run each: float32
56.1 -> 68.4 tok/s, bfloat16 82.0 -> 91.6 tok/s.

Where the kernel has no transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never`` or
missing, or Python's mmap lacks MADV_HUGEPAGE) nothing is moved.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line (and on any element size)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this kernel gives transparent huge pages to advised memory (``always`` or ``madvise``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _cpu_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.device.type == "cpu" and p.numel() > 0]


def arena_of(module: nn.Module) -> tuple[int, int] | None:
    """``(start, end)`` addresses of the module's weight region, or None when it has none."""
    return module.__dict__.get("_weight_arena_range")


def in_arena(module: nn.Module, t: torch.Tensor) -> bool:
    r = arena_of(module)
    return r is not None and r[0] <= t.data_ptr() < r[1]


def pack_weights(module: nn.Module) -> int:
    """Move every CPU parameter of ``module`` into one huge-page-advised region; returns the bytes moved (0 when
    nothing moved: no huge pages here, or every parameter is there already)."""
    params = _cpu_params(module)
    if not huge_pages_available() or all(in_arena(module, p) for p in params):
        return 0
    sizes = [p.numel() * p.element_size() for p in params]
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are huge from the start
    buf = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it lives
    off = (-buf.data_ptr()) % HUGE_PAGE
    start = buf.data_ptr() + off
    with torch.no_grad():
        for p, n in zip(params, sizes):
            view = buf[off : off + n].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            off += -(-n // _ALIGN) * _ALIGN
    module.__dict__["_weight_arena_range"] = (start, buf.data_ptr() + off)
    return total
