"""The collectives a sharded model runs inside its forward (torch.distributed), and the time they take."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from litellm_pipeline.parallel.shm import SharedRegion


class Collectives:
    """All-reduce (sum) and vocabulary all-gather over one process group (the engine's own, see
    ``workers._join``); counts the calls and the seconds spent in them
    (the driver's ``parallel`` metrics: time in collectives per step)."""

    def __init__(self, group: dist.ProcessGroup | None, world: int,
                 on_error: Callable[[BaseException], BaseException] | None = None, shm: SharedRegion | None = None,
                 timeout_s: float = 120.0, check: Callable[[], None] | None = None):
        self.group = group
        self.world = world
        # ranks on one machine: CPU tensors through shared memory (parallel/shm.py), the group for the rest
        self.shm = shm
        self.timeout_s = timeout_s
        self.check = check  # the driver's: raises where a worker process died
        self.calls = 0
        self.seconds = 0.0
        self.on_error = on_error  # the driver's: which rank died or hangs, as the error to raise

    def _failed(self, exc: BaseException) -> BaseException:
        return self.on_error(exc) if self.on_error is not None else exc

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        t = t.contiguous()
        try:
            if self.shm is not None and t.is_cpu and self.shm.fits(t):
                t = self.shm.all_reduce(t, self.timeout_s, self.check)
            else:
                self.group.allreduce([t]).wait()
        except Exception as exc:
            raise self._failed(exc) from exc
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return t

    def gather_vocab(self, local: torch.Tensor, chunk: int, vocab: int) -> torch.Tensor:
        """``[R, chunk]`` logits of every rank's vocabulary slice (the last padded) -> ``[R, vocab]`` on every rank."""
        t0 = time.perf_counter()
        if local.shape[-1] < chunk:
            local = torch.nn.functional.pad(local, (0, chunk - local.shape[-1]))
        local = local.contiguous()
        try:
            if self.shm is not None and local.is_cpu and self.shm.fits(local):
                parts = self.shm.all_gather(local, self.timeout_s, self.check)
            else:
                parts = [torch.empty_like(local) for _ in range(self.world)]
                self.group.allgather([parts], [local]).wait()
        except Exception as exc:
            raise self._failed(exc) from exc
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return torch.cat(parts, dim=-1)[..., :vocab]
