"""The collectives a sharded model runs inside its forward (torch.distributed), and the time they take."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


class Collectives:
    """All-reduce (sum) and vocabulary all-gather over one process group (the engine's own, see
    ``workers._join``); counts the calls and the seconds spent in them
    (the driver's ``parallel`` metrics: time in collectives per step)."""

    def __init__(self, group: dist.ProcessGroup | None, world: int,
                 on_error: Callable[[BaseException], BaseException] | None = None):
        self.group = group
        self.world = world
        self.calls = 0
        self.seconds = 0.0
        self.on_error = on_error  # the driver's: which rank died or hangs, as the error to raise

    def _failed(self, exc: BaseException) -> BaseException:
        return self.on_error(exc) if self.on_error is not None else exc

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        t = t.contiguous()
        try:
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
        parts = [torch.empty_like(local) for _ in range(self.world)]
        try:
            self.group.allgather([parts], [local.contiguous()]).wait()
        except Exception as exc:
            raise self._failed(exc) from exc
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return torch.cat(parts, dim=-1)[..., :vocab]
