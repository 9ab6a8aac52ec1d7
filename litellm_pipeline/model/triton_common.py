"""What the Triton kernels share: importing triton with a clear error, and where they may run.

Triton compiles for GPUs. On a CPU-only machine the same kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, read when ``triton`` is first imported), which executes them with numpy on CPU tensors:
this is how the kernels are tested without a GPU. Outside the interpreter a kernel needs its tensors on a CUDA
device, and calling it with CPU tensors is an error naming the setting, not a crash inside the compiler.
"""

from __future__ import annotations

import os

import torch

INSTALL_HINT = "pip install triton (or pip install 'litellm_pipeline[cuda]')"


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``): CPU tensors are fine."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton():
    """The ``triton`` module, or an ImportError that says how to get it."""
    try:
        import triton
    except ImportError as exc:
        raise ImportError(f"the triton kernels need the triton package ({INSTALL_HINT}): {exc}") from exc
    return triton


def check_device(t: torch.Tensor, what: str) -> None:
    """Refuse CPU tensors unless the interpreter runs the kernels."""
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{what}: Triton kernels run on CUDA tensors (got {t.device}); on a CPU they run only under Triton's "
            "interpreter, TRITON_INTERPRET=1 set before triton is imported (slow: for tests). Pick a CPU entry "
            "instead (attention cpu_paged, layer_ops cpu_fused, moe_dispatch fused)"
        )
