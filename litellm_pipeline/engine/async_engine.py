"""AsyncEngine: serves an ``Engine`` to asyncio code (the HTTP server) from one background stepping thread.

One thread, the *engine loop*, steps the engine while it has work and sleeps on a condition otherwise; each
request's deltas travel to the event loop that asked for them through ``call_soon_threadsafe`` into one
``asyncio.Queue`` per request. Every ``generate`` call shares that loop, so concurrent requests batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from litellm_pipeline.engine.engine import Engine
from litellm_pipeline.engine.request import RequestOutput
from litellm_pipeline.errors import InternalError, InvalidRequestError, OverloadedError
from litellm_pipeline.request_spec import Prompt, RequestSpec, to_spec
from litellm_pipeline.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineStepError"]

log = logging.getLogger(__name__)
_ids = itertools.count()


class EngineStepError(InternalError):
    """An engine step failed while this request was in flight; ``__cause__`` is the original exception."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or one exception that ends the stream


class AsyncEngine:
    """Asyncio front of an :class:`Engine`: ``start()``, ``generate(...)``, ``abort(id)``, ``shutdown()``.

    Also an async context manager (``async with AsyncEngine(engine) as aeng: ...``). An exception raised by
    one engine step fails only the requests in flight at that moment; the loop keeps serving new ones.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams: touched by the loop thread and by event loops
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine loop thread (a no-op if it already runs)."""
        if self.running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine loop and wait for it; requests still in flight are aborted and their streams
        raise. Idempotent."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            left = list(self._streams)
        self._fail(left, lambda rid: OverloadedError(f"request {rid!r} aborted: the AsyncEngine was shut down"))

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        # joining waits for the current step to end; do it off the event loop
        await asyncio.to_thread(self.shutdown)

    async def generate(
        self, prompt: Prompt | RequestSpec, params: SamplingParams | Mapping | None = None, **fields: Any
    ) -> AsyncIterator[RequestOutput]:
        """Submit a :class:`RequestSpec` (or a prompt plus its fields) and yield its deltas as the engine
        makes them, ending after the one with ``finished=True``.

        A rejected request raises its :class:`InvalidRequestError` at the first iteration, before anything
        is queued.
        Closing the iterator or cancelling the consuming task aborts the request and frees its KV at once.
        A failed engine step raises :class:`EngineStepError`.
        """
        if not self.running:
            raise OverloadedError("AsyncEngine is not running: call start() or use 'async with'")
        spec = to_spec(prompt, params, **fields)
        if spec.constraint is not None:  # a compile may take a while: not on the event loop
            try:
                await asyncio.to_thread(self.engine.prepare_constraint, spec)
            except InvalidRequestError:
                pass  # add_request refuses it below, as it refuses everything (and reports it)
        if spec.request_id is None:
            spec = spec.replace(request_id=f"async-{next(_ids)}")
        rid = spec.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        # register before submitting: the loop thread may produce this request's first delta at once
        with self._lock:
            if rid in self._streams:
                raise InvalidRequestError("request_id", f"{rid!r} is already in use")
            self._streams[rid] = stream
        submitted = done = False
        try:
            self.engine.add_request(spec)
            submitted = True
            with self._wake:
                self._wake.notify()
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item  # the finally still aborts: the error may have raced our add_request
                done = item.finished
                if item.error is not None:
                    raise EngineStepError(item.error, error_id=item.error_id)
                yield item
        finally:
            with self._lock:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            if submitted and not done:
                # synchronous on purpose: the blocks must be free when the consumer goes away, and the
                # engine lock is held for one step at most
                self.engine.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a ``finish_reason="abort"`` delta. Unknown ids are ignored."""
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver([out])

    # ---- engine loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopping:
                    return
            with self._lock:
                in_flight = list(self._streams)
            try:
                outs = self.engine.step()  # looked up each time: tests (and wrappers) may replace it
            except Exception as exc:  # an engine error must not kill the server: fail this step's requests
                error_id = InternalError("engine step failed").error_id
                log.exception("engine step failed (error id %s); failing %d request(s) in flight", error_id,
                              len(in_flight))
                self._fail(in_flight, lambda rid, exc=exc: self._step_error(rid, exc, error_id))
                continue
            self._deliver(outs)
            if not outs:
                # a step may legitimately emit nothing (a prompt chunk), but if the scheduler can plan
                # nothing either, don't spin: pause briefly (a new submission wakes us early)
                with self._wake:
                    if not self._stopping:
                        self._wake.wait(0.001)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's deltas to their streams: one wake-up per event loop per step, not one per delta (each
        wake-up is a write to the loop's self-pipe, and a busy server has dozens of streams on one loop)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outs:
                rid = out.request_id
                stream = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
                if stream is not None:  # else not ours (added straight to the engine) or its consumer left
                    batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is closed: nobody will ever read these requests
                for _, out in items:
                    self.engine.abort(out.request_id)

    @staticmethod
    def _step_error(rid: str, exc: Exception, error_id: str) -> EngineStepError:
        err = EngineStepError(f"request {rid!r} failed: engine step raised {type(exc).__name__}: {exc}", error_id)
        err.__cause__ = exc
        return err

    def _fail(self, request_ids: list[str], make_error: Callable[[str], BaseException]) -> None:
        """Abort each request and make its stream raise ``make_error(request_id)``."""
        for rid in request_ids:
            self.engine.abort(rid)
            with self._lock:
                stream = self._streams.pop(rid, None)
            if stream is None:
                continue
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, make_error(rid))
            except RuntimeError:  # its event loop is closed: nobody to tell
                pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:  # in step order: each request's deltas stay in order
        queue.put_nowait(out)
