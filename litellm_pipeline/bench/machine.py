"""What the machine was doing while the bench ran: threads, load average, and other processes' CPU use.

A 2-core box shared with anything else gives meaningless numbers (OpenMP threads stall when one core is
taken), so every phase records how many cores *other* processes used: total busy CPU time from
``/proc/stat`` minus the CPU time of this process and the processes it started (the llama.cpp peers), over the
phase's wall time.
"""

from __future__ import annotations

import os
import platform
import time

import torch


def _total_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user


def _own_cpu_s() -> float:
    """CPU time of this process and everything it started: its reaped children's (``os.times``) and its live
    descendants' (``/proc``), such as the llama.cpp peers it runs beside the engine."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _live_descendants_cpu_s()


def _live_descendants_cpu_s() -> float:
    """utime + stime (and their own reaped children's) of every live process below this one (Linux; else 0)."""
    parent, cpu = {}, {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # after "(comm)": state ppid ... utime(12) stime(13) cutime(14) cstime(15), counted from state=0
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[pid] = int(rest[1])
        cpu[pid] = sum(int(x) for x in rest[11:15])
    below, todo = [], [os.getpid()]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        below += kids
        todo += kids
    return sum(cpu[c] for c in below) / os.sysconf("SC_CLK_TCK")


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    try:
        import transformers  # noqa: F401  (only its version, when present)

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "loadavg_start": loadavg(),
        "cpu_model": _cpu_model(),
        "bf16_row_linear": _row_linear_path(),
        **_precision_support(),
    }


def _cpu_model() -> str | None:
    """``model name`` of /proc/cpuinfo (Linux), the CPU a number came from."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _row_linear_path() -> str | None:
    """Which arithmetic the batch-invariant mode's bf16 linear takes here (amx, avx512_bf16, avx512)."""
    try:
        from litellm_pipeline.model import cpu_kernels

        return cpu_kernels.ops().row_linear_path()
    except Exception:  # no compiler: the mode runs the torch reference
        return None


def _precision_support() -> dict:
    """What this CPU does per precision: the kernels' vector ISA and whether 16-bit products are native (else the
    16-bit GEMMs over many rows run as float32 on widened operands)."""
    try:
        from litellm_pipeline.model import cpu_kernels

        ns = cpu_kernels.ops()
        return {"simd": ns.simd_isa(), "native_bf16": ns.native_bf16_gemm(), "native_fp16": ns.native_fp16_gemm(),
                "int8_kernel": ns.int8_linear_isa(), "int4_kernel": ns.int4_linear_isa()}
    except Exception:
        return {"simd": None, "native_bf16": None, "native_fp16": None, "int8_kernel": None, "int4_kernel": None}


class CpuMonitor:
    """``mark(name)`` closes a phase and records other processes' average CPU use (cores) during it."""

    def __init__(self) -> None:
        self.phases: list[dict] = []
        self._start = self._snap()

    @staticmethod
    def _snap() -> tuple[float, float | None, float]:
        return time.monotonic(), _total_busy_s(), _own_cpu_s()

    def mark(self, name: str) -> dict:
        (w0, b0, o0), (w1, b1, o1) = self._start, self._snap()
        self._start = (w1, b1, o1)
        wall = max(w1 - w0, 1e-9)
        others = None if b0 is None or b1 is None else max(0.0, (b1 - b0) - (o1 - o0)) / wall
        phase = {"phase": name, "wall_s": round(wall, 3), "own_cores": round((o1 - o0) / wall, 2),
                 "other_cores": None if others is None else round(others, 2), "loadavg": loadavg()}
        self.phases.append(phase)
        return phase

    def busy_phases(self, threshold: float, min_wall_s: float = 0.4, phases: list[dict] | None = None) -> list[dict]:
        """Phases in which other processes used more than ``threshold`` cores (short ones are too noisy)."""
        return [p for p in (self.phases if phases is None else phases)
                if p["other_cores"] is not None and p["other_cores"] > threshold and p["wall_s"] >= min_wall_s]
