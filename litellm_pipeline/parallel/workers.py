"""The driver and its workers (vLLM's split): the driver (rank 0) schedules, budgets, serves and counts, and runs its
own shard of the model; each worker holds one more shard and its KV cache and runs only what the driver sends it.

Every call into the driver's model (a step's forward, the LM head on its sampled rows) and every copy of KV blocks
between the hot and warm pools is first broadcast to the workers over a gloo group of its own (commands can wait
for as long as the engine idles); the model's collectives run over the main group, whose timeout turns a rank
that stops answering into an error naming it. On one machine the driver starts the workers itself (spawned
processes that exit when it does); under ``torchrun`` every rank starts from the same command line and ranks
past 0 serve the driver (:func:`serve_torchrun`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.parallel import shm
from litellm_pipeline.parallel.comm import Collectives
from litellm_pipeline.parallel.shm import SharedRegion
from litellm_pipeline.parallel.shard import Shard, make_shard

_POLL_S = 0.2
_FOREVER = datetime.timedelta(days=365)
_FROM_DRIVER = dist.BroadcastOptions()
_FROM_DRIVER.rootRank = 0


class ParallelError(RuntimeError):
    """A rank died or stopped answering: the engine cannot run its model any more (every later call says so)."""


def torchrun_env() -> tuple[int, int] | None:
    """``(rank, world)`` where torchrun (or another launcher of its convention) started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def backend_for(setting: str, device: torch.device, local_ranks: int) -> str:
    """``auto``: NCCL where every rank on this machine has a GPU of its own, else gloo (CPU tensors, or ranks that
    share one GPU, which NCCL refuses)."""
    if setting != "auto":
        if setting == "nccl" and device.type != "cuda":
            raise ConfigError("parallel.backend=nccl needs device.type=cuda (gloo runs on CPU)")
        return setting
    return "nccl" if device.type == "cuda" and torch.cuda.device_count() >= local_ranks else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the rank ``local_rank`` of this machine: its own GPU where there are enough (shared round
    robin where not), the CPU for a CPU engine."""
    if device.type != "cuda":
        return device
    d = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    torch.cuda.set_device(d)
    return d


def local_world(world: int) -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE, else all ``world`` (the workers started here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def threads_per_rank(app, local_ranks: int) -> int | None:
    """CPU threads of each rank where device.threads does not say: the cores shared out, so that ranks on one
    machine do not oversubscribe them."""
    if app.device.threads:
        return app.device.threads
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


@dataclasses.dataclass
class Member:
    """This process's place in a parallel engine: its shard and the collectives its model runs over."""

    shard: Shard
    comm: Collectives
    device: torch.device
    driver: Driver | None = None  # on rank 0


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _join(init_method: str, rank: int, world: int, backend: str, timeout_s: float, start_timeout_s: float):
    """Meet the other ranks at ``init_method`` and make this engine's two groups: the model's collectives (``backend``,
    with the hang timeout) and the commands (gloo, no limit: a worker waits as long as the engine idles). The groups
    are the engine's own, not torch.distributed's default group, so one process can hold several parallel engines
    (a bench comparing splits, a test suite) and any other code's default group is left alone."""
    store, rank, world = next(dist.rendezvous(init_method, rank=rank, world_size=world,
                                              timeout=datetime.timedelta(seconds=start_timeout_s)))
    main = _group(backend, dist.PrefixStore("model/", store), rank, world, datetime.timedelta(seconds=timeout_s))
    cmd = _group("gloo", dist.PrefixStore("commands/", store), rank, world, _FOREVER)
    return main, cmd


def _group(backend: str, store, rank: int, world: int, timeout: datetime.timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def start_driver(app, mc, device: torch.device) -> Member:
    """Rank 0: start the workers on this machine (or join torchrun's ranks) and return its own member."""
    p = app.parallel
    world = max(p.tensor, p.expert)
    shard = make_shard(p.tensor, p.expert, 0, mc)  # refuses a split the model cannot take before anything starts
    backend = backend_for(p.backend, device, local_world(world))
    env = torchrun_env()
    procs: list = []
    region = None
    if env is not None:
        rank, env_world = env
        if env_world != world:
            raise ConfigError(f"parallel: torchrun started {env_world} ranks but tensor={p.tensor} expert={p.expert} "
                              f"needs {world}")
        if rank != 0:
            raise ConfigError(f"rank {rank} builds an engine: only rank 0 drives (the others run serve_torchrun)")
        init = "env://"
    else:
        port = p.master_port or _free_port(p.master_addr)
        init = f"tcp://{p.master_addr}:{port}"
        # commands, and the collectives of CPU tensors, through shared memory (gloo over loopback is slower)
        region = SharedRegion.create(world) if shm.usable() else None
    driver = Driver(world, procs, region, p.timeout_s)
    try:
        if env is None:
            state = json.dumps(app.model_dump(mode="json"))
            for r in range(1, world):
                procs.append(_spawn(state, r, init, backend, region.path if region is not None else "-"))
        joined: dict[str, Any] = {}
        joiner = threading.Thread(target=lambda: joined.update(
            groups=_join(init, 0, world, backend, p.timeout_s, p.start_timeout_s)), daemon=True)
        joiner.start()
        deadline = time.monotonic() + p.start_timeout_s
        while joiner.is_alive():
            joiner.join(_POLL_S)
            driver.check_alive("before joining")
            if time.monotonic() > deadline:
                raise ParallelError(f"parallel: the workers did not join within parallel.start_timeout_s="
                                    f"{p.start_timeout_s:g} s")
        if "groups" not in joined:
            raise ParallelError("parallel: joining the process group failed (see the error above)")
        main, driver.cmd_group = joined["groups"]
        driver.start_deadline = deadline
        if region is not None:  # every worker has it mapped by now: nothing is left in /dev/shm whatever happens
            region.remove()
    except BaseException:
        driver.close()
        raise
    comm = Collectives(main, world, on_error=driver.diagnose, shm=region, timeout_s=p.timeout_s,
                       check=driver.check_running)
    return Member(shard, comm, rank_device(device, int(os.environ.get("LOCAL_RANK", 0))), driver)


class Driver:
    """Rank 0's handle on the workers: sends them commands, watches them, shuts them down."""

    def __init__(self, world: int, procs: list, region: SharedRegion | None, timeout_s: float):
        self.world = world
        self.procs = procs
        self.region = region
        self.timeout_s = timeout_s
        self._life = _Life(procs, region)
        self.start_deadline = 0.0
        self.sent = 0
        self.closed = False
        self.hot_kv: list | None = None
        self.tensor_parallel = False
        self.copies = 0  # KV block copies sent to the workers
        self.forwards = 0  # model steps sent to the workers
        # an engine dropped without close(), or still open at exit: its workers are stopped all the same (a killed
        # driver: they watch for it and exit)
        self._stop = weakref.finalize(self, _stop, self._life)

    # ---- start
    def wait_ready(self) -> None:
        """Wait for every spawned worker to have built its shard (a failure names the rank and its error)."""
        if not self.procs:
            if self.cmd_group is not None:  # torchrun: a barrier (each rank prints its own failure)
                self._send(("ready",))
            return
        waiting = {proc.report: (r, proc) for r, proc in enumerate(self.procs, start=1)}
        while waiting:
            got, _, _ = select.select(list(waiting), [], [], _POLL_S)
            for fd in got:
                r, proc = waiting[fd]
                chunk = os.read(fd, 4096)
                proc.buf += chunk
                if b"\n" not in proc.buf and chunk:
                    continue
                line = proc.buf.split(b"\n", 1)[0].decode(errors="replace")
                del waiting[fd]
                os.close(fd)
                proc.report = None
                if line != "ready":
                    raise ParallelError(f"parallel: rank {r} failed to start: {line or 'it exited'}")
            self.check_alive("while loading its shard")
            if waiting and time.monotonic() > self.start_deadline:
                raise ParallelError(f"parallel: rank(s) {sorted(r for r, _ in waiting.values())} did not load their "
                                    f"shards within parallel.start_timeout_s")

    # ---- health
    def check_alive(self, when: str) -> None:
        for r, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                code = proc.exitcode
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise ParallelError(f"parallel: rank {r} (pid {proc.pid}) died {when} ({how})")

    def check_running(self) -> None:
        self.check_alive(f"during command {self.sent}")

    def diagnose(self, exc: BaseException) -> ParallelError:
        """The error of a failed collective: which rank died or fell behind. The engine stays broken after it."""
        time.sleep(_POLL_S)  # a rank that was killed is reaped by now
        why = None
        try:
            self.check_alive(f"during command {self.sent}")
        except ParallelError as dead:
            why = str(dead)
        if why is None and isinstance(exc, ParallelError):
            why = str(exc)
        if why is None and self.region is not None:
            region = self.region
            behind = [r for r in range(1, self.world) if region.acks(r) < region.commands]
            if behind or isinstance(exc, TimeoutError):
                behind = behind or [r for r in range(1, self.world)]
                why = (f"parallel: rank(s) {behind} did not answer within parallel.timeout_s={self.timeout_s:g} s "
                       f"(command {self.sent}: {exc})")
        if why is None:
            why = f"parallel: a collective failed on rank 0: {exc}"
        self.broken = why
        _reap(self.procs, None)  # the engine cannot step any more: the other workers go now, not at close()
        return ParallelError(why)

    def _usable(self) -> None:
        if self.broken is not None:
            raise ParallelError(self.broken)
        if self.closed:
            raise ParallelError("parallel: the engine was closed (its workers are gone)")

    def _send(self, msg: tuple) -> None:
        self._usable()
        if not self._life.lock.acquire(timeout=self.timeout_s):
            raise ParallelError(f"parallel: another thread held the workers for parallel.timeout_s="
                                f"{self.timeout_s:g} s")
        try:
            self._send_locked(msg)
        finally:
            self._life.lock.release()

    def _send_locked(self, msg: tuple) -> None:
        self.sent += 1
        try:
            if self.region is not None:
                self.region.send(dumps(msg), self.timeout_s, self.check_running)
            else:
                send_command(msg, self.cmd_group, self.timeout_s)
        except Exception as exc:
            raise self.diagnose(exc) from exc

    # ---- what the workers mirror
    def forward(self, input_ids, meta, kv_caches, plan, rope_seq_lens, logits) -> None:
        self._usable()
        if kv_caches is not self.hot_kv:
            raise ParallelError("parallel: a model call with KV caches other than the engine's (the workers hold only "
                                "the engine's own)")
        # expert parallel alone: every rank holds the whole LM head, the driver's logits are enough
        self._send(("forward", input_ids, dataclasses.replace(meta, _decode_masks={}), plan, rope_seq_lens,
                    logits and self.tensor_parallel))
        self.forwards += 1

    def compute_logits(self, hidden: torch.Tensor) -> bool:
        """Send the LM head of ``hidden`` where it is split (tensor parallel); whether the workers run it."""
        if self.tensor_parallel:
            self._send(("logits", hidden))
        return self.tensor_parallel

    @contextlib.contextmanager
    def call(self):
        """The driver's own part of a call the workers were sent: while it runs, a close() does not wait for them;
        if it raises, the workers are left mid-call (their collectives would wait for the driver's), so the engine
        is broken with the driver's error and the workers are stopped at once."""
        self._life.in_call = True
        try:
            yield
        except BaseException as exc:
            if self.broken is None:
                self.broken = f"parallel: rank 0 failed in the middle of a model call: {type(exc).__name__}: {exc}"
                _reap(self.procs, None)
            raise
        finally:
            self._life.in_call = False

    def copy_blocks(self, to_warm: bool, src_ids: list[int], dst_ids: list[int]) -> None:
        if src_ids:
            self._send(("copy", to_warm, list(src_ids), list(dst_ids)))
            self.copies += 1

    # ---- stop
    def close(self) -> None:
        """Stop the workers (a stop command where they can take it; killed where not) and leave the groups."""
        if self.closed:
            return
        self.closed = True
        self._stop()
        self.hot_kv = None  # the KV cache is given back with the engine

    # what stopping needs lives apart from the driver, so that a driver dropped without close() stops them too
    @property
    def cmd_group(self):
        return self._life.cmd_group

    @cmd_group.setter
    def cmd_group(self, group) -> None:
        self._life.cmd_group = group

    @property
    def broken(self) -> str | None:
        return self._life.broken

    @broken.setter
    def broken(self, why: str | None) -> None:
        self._life.broken = why


class _Life:
    def __init__(self, procs: list, region: SharedRegion | None):
        self.procs, self.region = procs, region
        self.cmd_group = None
        self.broken: str | None = None
        self.lock = threading.Lock()  # one sender at a time (a close() from a signal handler or another thread)
        self.in_call = False  # the workers are inside a model call: they cannot take a stop command now


def _stop(life: _Life) -> None:
    """A stop command where the workers can take it, a wait for them (not for a hung one, nor for workers in the
    middle of a call, nor while another thread sends), then :func:`_reap`."""
    graceful = life.broken is None and not life.in_call and life.lock.acquire(timeout=1.0)
    if graceful:
        try:
            if life.region is not None:
                life.region.send(dumps(("stop",)), 5.0)
            elif life.cmd_group is not None:
                send_command(("stop",), life.cmd_group, 5.0)
        except Exception:
            graceful = False
        finally:
            life.lock.release()
    deadline = time.monotonic() + (10.0 if graceful else 0.0)
    for proc in life.procs:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _reap(life.procs, life.region)
    life.cmd_group = None  # the groups' connections close with them


def _reap(procs: list, region: SharedRegion | None) -> None:
    """Kill what is left of ``procs`` (a stop command was tried first, or cannot be taken) and remove the region."""
    for proc in procs:
        if proc.exitcode is None:
            proc.popen.kill()
        proc.popen.wait(5.0)
        if proc.report is not None:
            try:
                os.close(proc.report)
            except OSError:
                pass
            proc.report = None
    if region is not None:
        region.remove()


# ---- commands: pickled, tensors as their raw bytes (torch's own tensor pickling costs ~0.3 ms a step)
def _tensor(raw: bytes, dtype: str, shape: tuple) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            return _tensor, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), str(t.dtype).removeprefix("torch."),
                             tuple(t.shape))
        return NotImplemented


def dumps(msg: tuple) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return buf.getvalue()


# ---- commands over gloo (torchrun): a length, then the pickled command, broadcast from rank 0 over the command group
def send_command(msg: tuple, group, timeout_s: float) -> None:
    """Broadcast ``msg`` to the workers; a worker that does not take it within ``timeout_s`` raises (a gloo send
    waits for its receiver)."""
    payload = dumps(msg)
    limit = datetime.timedelta(seconds=timeout_s)
    for t in (torch.tensor([len(payload)], dtype=torch.long), torch.frombuffer(bytearray(payload), dtype=torch.uint8)):
        group.broadcast([t], _FROM_DRIVER).wait(limit)


def receive_command(group) -> tuple:
    """The driver's next command (waits as long as the engine idles)."""
    size = torch.empty(1, dtype=torch.long)
    group.broadcast([size], _FROM_DRIVER).wait()
    buf = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast([buf], _FROM_DRIVER).wait()
    return pickle.loads(buf.numpy().tobytes())


# ---- workers
class _Proc:
    """A worker process started here, with the pipe it reports its start on."""

    def __init__(self, popen: subprocess.Popen, report: int):
        self.popen = popen
        self.pid = popen.pid
        self.report = report
        self.buf = b""

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()


def _spawn(state: str, rank: int, init: str, backend: str, counters: str) -> _Proc:
    """Start rank ``rank`` as ``python -m litellm_pipeline.parallel.workers`` (not multiprocessing's spawn, which
    would run the driver's own script again in the child): the config on stdin, its start reported on a pipe."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "litellm_pipeline.parallel.workers", str(rank), init, backend, counters,
           str(os.getpid()), str(w)]
    popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(w,))
    os.close(w)
    popen.stdin.write(state.encode())
    popen.stdin.close()
    return _Proc(popen, r)


def _worker_main(argv: list[str]) -> None:
    """A worker process on the driver's machine: join, build its shard, serve; exit when the driver goes."""
    rank, init, backend, region_path, parent, report = (int(argv[0]), argv[1], argv[2], argv[3], int(argv[4]),
                                                        int(argv[5]))
    # Ctrl-C and a SIGTERM to the whole process group reach the workers too: the driver handles them (it drains, then
    # stops them); a worker whose driver is gone exits on its own (watch_parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    from litellm_pipeline.config.schema import AppConfig

    app = AppConfig.model_validate(json.loads(sys.stdin.read()))
    world = max(app.parallel.tensor, app.parallel.expert)
    region = SharedRegion(region_path, world, rank) if region_path != "-" else None
    main, cmd_group = _join(init, rank, world, backend, app.parallel.timeout_s, app.parallel.start_timeout_s)
    try:
        rt = _build_worker(app, rank, rank, main, region)
    except BaseException as exc:
        os.write(report, f"{type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
        os._exit(4)
    os.write(report, b"ready\n")
    os.close(report)
    os._exit(serve(rt, cmd_group, rank, region))


def _build_worker(app, rank: int, local_rank: int, group, region: SharedRegion | None = None):
    from litellm_pipeline.config.build import build_from_app
    from litellm_pipeline.model.loader import load_model_config

    p = app.parallel
    mc = load_model_config(app.model.path) if app.model.path else None
    if mc is None:
        from litellm_pipeline.demo import demo_checkpoint

        mc = load_model_config(demo_checkpoint())
    from litellm_pipeline.config.build import resolve_device

    device = rank_device(resolve_device(app.device.type), local_rank)
    comm = Collectives(group, max(p.tensor, p.expert), shm=region, timeout_s=p.timeout_s)
    member = Member(make_shard(p.tensor, p.expert, rank, mc), comm, device)
    return build_from_app(app, member=member).rt


def _moved(x, device: torch.device):
    """``x`` (tensors in tuples, lists and dataclasses such as AttentionMetadata and RoutePlan) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(v, device) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _moved(getattr(x, f.name), device) for f in dataclasses.fields(x)
                                         if f.init})
    return x


def serve(rt, cmd_group, rank: int, region: SharedRegion | None = None) -> int:
    """A worker's loop: run each command of the driver on this rank's shard until it says stop. Returns the exit
    code (0 after stop; 1 where a command failed, whose error it prints)."""
    model, hot = rt.model, rt.kv_caches
    warm = rt.kv.warm
    n = 0
    try:
        while True:
            msg = pickle.loads(region.receive()) if region is not None else receive_command(cmd_group)
            n += 1
            op = msg[0]
            if op == "stop":
                return 0
            if rt.device.type == "cuda":  # tensors arrive on the driver's GPU: this rank's own
                msg = _moved(msg, rt.device)
            with torch.inference_mode():
                if op == "forward":
                    _, ids, meta, plan, rope, logits = msg
                    model(ids, meta, hot, plan, rope, logits=logits)
                elif op == "logits":
                    model.compute_logits(msg[1])
                elif op == "copy":
                    _, to_warm, src_ids, dst_ids = msg
                    src, dst = (hot, warm.kv) if to_warm else (warm.kv, hot)
                    from litellm_pipeline.engine.kv_cache_manager import copy_blocks

                    copy_blocks(src, src_ids, dst, dst_ids, rt.block_size)
    except Exception:
        print(f"litellm_pipeline: rank {rank} stops at command {n}:\n{traceback.format_exc()}", file=sys.stderr)
        return 1


def serve_torchrun(cfg) -> int:
    """A rank past 0 under torchrun: build this rank's shard from the same config as the driver and serve it."""
    from litellm_pipeline.config.build import to_plain
    from litellm_pipeline.config.schema import validate_config

    rank, world = torchrun_env()
    app = validate_config(to_plain(cfg))
    p = app.parallel
    if world != max(p.tensor, p.expert):
        raise ConfigError(f"parallel: torchrun started {world} ranks but tensor={p.tensor} expert={p.expert} needs "
                          f"{max(p.tensor, p.expert)}")
    from litellm_pipeline.config.build import resolve_device

    backend = backend_for(p.backend, resolve_device(app.device.type), local_world(world))
    main, cmd_group = _join("env://", rank, world, backend, p.timeout_s, p.start_timeout_s)
    rt = _build_worker(app, rank, int(os.environ.get("LOCAL_RANK", 0)), main)
    if receive_command(cmd_group)[0] == "stop":  # the driver's "ready" (every rank has its shard), or its end
        return 0
    return serve(rt, cmd_group, rank)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
