"""Engine: runs the built stage graph. Requests go through the request-level stages when submitted; each
``step()`` schedules the batch and runs the step-level stages over it."""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from litellm_pipeline.engine.request import Request, RequestOutput, RequestStatus
from litellm_pipeline.engine.runtime import Runtime
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.stages.base import RequestContext, Stage, StepContext
from litellm_pipeline.stages.emit import request_output


class Engine:
    """Thread-safe: ``add_request``, ``abort`` and ``step`` may be called from different threads."""

    def __init__(self, rt: Runtime, request_stages: Sequence[Stage], step_stages: Sequence[Stage]):
        self.rt = rt
        self.request_stages = list(request_stages)
        self.step_stages = list(step_stages)
        self.requests: dict[str, Request] = {}
        self._lock = threading.RLock()

    @property
    def tokenizer(self):
        return self.rt.tokenizer

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tier: str | None = None,
        salt: str = "",
        priority: int = 0,
        session_id: str | None = None,
    ) -> Request:
        """Run the request-level stages; a request that fails any of them leaves nothing behind."""
        params = params or SamplingParams()
        ids = self.rt.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        req = Request(prompt_ids=ids, params=params, tier=tier, salt=salt, priority=priority, session_id=session_id)
        if request_id is not None:
            req.request_id = request_id
        with self._lock:
            if req.request_id in self.requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            ctx = RequestContext(req)
            try:
                for stage in self.request_stages:
                    stage(ctx)
            except Exception:
                self.rt.scheduler.finish(req) if req in self.rt.scheduler.waiting else None
                raise
            self.requests[req.request_id] = req
        return req

    def step(self) -> list[RequestOutput]:
        """One engine step over every running request; returns the deltas it produced."""
        with self._lock, torch.inference_mode():
            schedule = self.rt.scheduler.schedule()
            if not schedule:
                return []
            schedule.sort(key=lambda e: e[1] == 1)  # row order: prompt chunks first, then decodes
            ctx = StepContext(schedule)
            for stage in self.step_stages:
                stage(ctx)
            for out in ctx.outputs:
                if out.finished:
                    self.requests.pop(out.request_id, None)
            return ctx.outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free all its KV blocks at once."""
        with self._lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return None
            req.finish_reason = "abort"
            self.rt.scheduler.finish(req)
            req.status = RequestStatus.FINISHED
            return request_output(req)

    def end_session(self, session_id: str) -> bool:
        """Release a session's pinned KV now (it also expires after ``cache.session_ttl_s``)."""
        with self._lock:
            return self.rt.kv.end_session(session_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.rt.scheduler.has_unfinished()
