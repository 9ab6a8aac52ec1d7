"""Ranks on one machine: the driver's commands and the CPU collectives through one shared file mapping.

gloo over TCP loopback costs about a millisecond per small all-reduce on a 2-core machine (the wake-ups of its
threads), more than a whole decode step of a small model. Here each rank writes its part into its own slot and
raises its flag; the others spin (yielding the core) until every flag is up, then read. Every rank adds the slots
in rank order, so every rank gets the same bits. Two slot sets alternate, so a rank may start the next operation
while another still reads the last one: nobody can be two ahead. Commands go the same way: the driver writes a
pickled command (in chunks where it is large) and waits for each worker's acknowledgement before the next chunk.

Layout: a control page of int64 (command sequence and length, one acknowledgement per rank, two rows of reduce
flags), the command area, then two sets of one slot per rank. Stores are ordered on x86 (data before its flag);
other architectures take the gloo path (:func:`usable`).
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
from typing import Callable

import torch

_CTRL = 4096
_SEQ, _LEN, _TOTAL = 0, 1, 2
_ACK = 8  # + rank
_FLAGS = 256  # + parity * world + rank
CMD_BYTES = 4 << 20
SLOT_BYTES = 4 << 20
_SPIN_S = 0.02  # a worker spins this long after a command before it sleeps between looks


def usable() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class SharedRegion:
    """The mapping of one parallel engine, ``world`` ranks; ``rank`` is this process's."""

    def __init__(self, path: str, world: int, rank: int, create: bool = False):
        if world > _FLAGS - _ACK or 2 * world > _CTRL // 8 - _FLAGS:
            raise ValueError(f"shared region: at most {(_CTRL // 8 - _FLAGS) // 2} ranks")
        self.path, self.world, self.rank = path, world, rank
        size = _CTRL + CMD_BYTES + 2 * world * SLOT_BYTES
        if create:  # backed now (a sparse file on a full /dev/shm would fault at the first write, not here)
            with open(path, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, size)
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), size)
        self.ctrl = memoryview(self._map)[:_CTRL].cast("q")
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self.seq = 0  # reduce operations done (every rank does the same ones)
        self.commands = 0  # commands sent (driver) or taken (worker)

    @classmethod
    def create(cls, world: int) -> SharedRegion | None:
        """A new region for ``world`` ranks; None where /dev/shm cannot hold it (then the ranks use gloo)."""
        fd, path = tempfile.mkstemp(prefix="litellm-parallel-", dir="/dev/shm")
        os.close(fd)
        try:
            return cls(path, world, 0, create=True)
        except OSError:
            os.unlink(path)
            return None

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def acks(self, rank: int) -> int:
        """Commands rank ``rank`` has taken."""
        return self.ctrl[_ACK + rank]

    # ---- waiting
    def _wait(self, ready: Callable[[], bool], timeout_s: float | None, check: Callable[[], None] | None,
              what: Callable[[], str]) -> None:
        """Spin (yielding the core) until ``ready()``; past ``_SPIN_S`` sleep between looks (an idle engine costs
        nothing); ``check()`` every 0.1 s (a dead peer raises there); past ``timeout_s`` a TimeoutError."""
        if ready():
            return
        t0 = time.monotonic()
        next_check = t0 + 0.1
        nap = 0.0
        while not ready():
            if nap:
                time.sleep(nap)
            else:
                os.sched_yield()
            now = time.monotonic()
            if now - t0 > _SPIN_S:
                nap = min(0.002, max(nap * 2, 5e-5))
            if now > next_check:
                next_check = now + 0.1
                if check is not None:
                    check()
                if timeout_s is not None and now - t0 > timeout_s:
                    raise TimeoutError(what())

    # ---- collectives (CPU tensors)
    def _slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        off = _CTRL + CMD_BYTES + (parity * self.world + rank) * SLOT_BYTES
        return self._buf[off : off + numel * dtype.itemsize].view(dtype)

    def _exchange(self, t: torch.Tensor, timeout_s: float, check) -> tuple[int, int]:
        self.seq += 1
        seq, p, w = self.seq, self.seq & 1, self.world
        self._slot(p, self.rank, t.dtype, t.numel()).copy_(t.reshape(-1))
        self.ctrl[_FLAGS + p * w + self.rank] = seq
        flags = self.ctrl
        self._wait(lambda: all(flags[_FLAGS + p * w + r] == seq for r in range(w)), timeout_s, check,
                   lambda: f"rank(s) {[r for r in range(w) if flags[_FLAGS + p * w + r] != seq]} did not reach "
                           f"collective {seq} within {timeout_s:g} s")
        return p, t.numel()

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= SLOT_BYTES

    def all_reduce(self, t: torch.Tensor, timeout_s: float, check=None) -> torch.Tensor:
        """The sum over ranks of ``t`` (each rank's slot added in rank order: the same bits on every rank)."""
        p, n = self._exchange(t, timeout_s, check)
        out = self._slot(p, 0, t.dtype, n).clone()
        for r in range(1, self.world):
            out += self._slot(p, r, t.dtype, n)
        return out.view(t.shape)

    def all_gather(self, t: torch.Tensor, timeout_s: float, check=None) -> list[torch.Tensor]:
        p, n = self._exchange(t, timeout_s, check)
        return [self._slot(p, r, t.dtype, n).clone().view(t.shape) for r in range(self.world)]

    # ---- commands (driver -> workers)
    def send(self, payload: bytes, timeout_s: float, check=None) -> None:
        """Write ``payload`` for every worker, a chunk at a time, each chunk taken by all before the next."""
        total, done, w = len(payload), 0, self.world
        ctrl = self.ctrl
        while True:
            chunk = payload[done : done + CMD_BYTES]
            if chunk:
                self._buf[_CTRL : _CTRL + len(chunk)].copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
            ctrl[_LEN], ctrl[_TOTAL] = len(chunk), total
            self.commands += 1
            n = self.commands
            ctrl[_SEQ] = n  # last: a worker reads the chunk once it sees this
            self._wait(lambda: all(ctrl[_ACK + r] >= n for r in range(1, w)), timeout_s, check,
                       lambda: f"rank(s) {[r for r in range(1, w) if ctrl[_ACK + r] < n]} did not take command "
                               f"chunk {n} within {timeout_s:g} s")
            done += len(chunk)
            if done >= total:
                return

    def receive(self) -> bytes:
        """The driver's next command (waits as long as the engine idles)."""
        ctrl, parts, total = self.ctrl, [], None
        while total is None or sum(map(len, parts)) < total:
            n = self.commands + 1
            self._wait(lambda: ctrl[_SEQ] >= n, None, None, str)
            length, total = ctrl[_LEN], ctrl[_TOTAL]
            parts.append(self._buf[_CTRL : _CTRL + length].numpy().tobytes())
            self.commands = n
            ctrl[_ACK + self.rank] = n
            if total == 0:
                break
        return b"".join(parts)
