"""Fan-in: one API request's engine requests (``n`` choices, several prompts) as one ordered stream of deltas.

Each choice runs in its own task consuming ``AsyncEngine.generate``; their deltas meet in one queue, so a
streaming response interleaves choices as the engine makes them and they all batch in the same engine steps.
Cancelling the fan-in cancels the tasks, and ``AsyncEngine.generate`` aborts a cancelled request and frees its
KV blocks at once.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from litellm_pipeline.engine.async_engine import AsyncEngine
from litellm_pipeline.engine.request import RequestOutput
from litellm_pipeline.server.specs import Choice

__all__ = ["FanIn"]

_END = object()


class FanIn:
    """``await FanIn.open(aeng, choices)``, then ``async for index, delta in fanin``; ``cancel()`` aborts all.

    :meth:`open` returns only once every choice was admitted or one was refused: a refusal (an
    ``InvalidRequestError`` from the engine's request stages) is raised there, before any response starts,
    with the choices already admitted aborted.
    """

    def __init__(self, aeng: AsyncEngine, choices: list[Choice]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._failure: BaseException | None = None
        self._tasks = [asyncio.create_task(self._consume(aeng, c)) for c in choices]
        self._open = len(self._tasks)

    @classmethod
    async def open(cls, aeng: AsyncEngine, choices: list[Choice]) -> FanIn:
        fan = cls(aeng, choices)
        # One yield runs every task up to its first real wait: AsyncEngine.generate submits synchronously at
        # its first iteration, so each task has now either been admitted (and waits for deltas) or failed.
        await asyncio.sleep(0)
        if fan._failure is not None:
            # the engine loop may have run the admitted choices meanwhile: the API request is refused, so
            # what their quotas took comes back in full (now, before the cancelled tasks abort them plainly)
            for c in choices:
                req = aeng.engine.requests.get(c.spec.request_id)
                if req is not None and req.spec is c.spec:  # this choice's, not another request's of that id
                    aeng.engine.abort(c.spec.request_id, refund=True)
            fan.cancel()
            raise fan._failure
        return fan

    async def _consume(self, aeng: AsyncEngine, choice: Choice) -> None:
        # failures travel through the queue (and _failure), so no task ever ends with an unread exception
        try:
            async for out in aeng.generate(choice.spec):
                self._queue.put_nowait((choice.index, out))
        except Exception as exc:
            if self._failure is None:
                self._failure = exc
            self._queue.put_nowait((choice.index, exc))
        finally:
            self._queue.put_nowait(_END)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas as ``(choice index, RequestOutput)``; the first failure of any choice is raised (and the
        others aborted)."""
        try:
            while self._open:
                item = await self._queue.get()
                if item is _END:
                    self._open -= 1
                    continue
                index, out = item
                if isinstance(out, BaseException):
                    raise out
                yield index, out
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Abort every choice still running (idempotent)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
