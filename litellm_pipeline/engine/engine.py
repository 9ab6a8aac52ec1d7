"""Engine: runs the built stage graph and owns every request's bookkeeping.

Request path (``add_request``): the request-level stages (admit, select_tier, ...) run on a request that
does not exist in the engine yet; they decide and may reject. Only when all of them pass does the engine
name the request, give it its generator and detokenizer and queue it — so a rejection leaves nothing.

Step path (``step``): the scheduler decides ``{request: tokens}``; the KV manager lays out where those
tokens' K/V live; the step-level stages transform the step context (route → prefill → decode → sample →
emit); then :meth:`Engine._postprocess` does the bookkeeping no stage may skip: the scheduler advances
computed tokens and commits KV (it alone touches its queues and the KV of its requests: it also finishes and
frees), the engine appends sampled tokens and decides which requests finish.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from litellm_pipeline.constraints.grammar import bitmask_words
from litellm_pipeline.engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    request_output,
)
from litellm_pipeline.engine.runtime import Runtime
from litellm_pipeline.errors import InternalError, InvalidRequestError
from litellm_pipeline.request_spec import Prompt, RequestSpec, to_spec
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.stages.base import RequestContext, Stage, StepContext
from litellm_pipeline.telemetry import (
    FirstToken,
    RequestAborted,
    RequestAdmitted,
    RequestArrived,
    RequestCosted,
    RequestFinished,
    RequestRejected,
    StepFinished,
    TierSelected,
    TokensGenerated,
)
from litellm_pipeline.text.detokenizer import IncrementalDetokenizer
from litellm_pipeline.text.tokenizer import TokenizerError

# the longest a step waits for a thread that asked for the lock before it to take it (that thread may be
# descheduled; then the step goes ahead and the thread gets the lock after it)
_HANDOFF_WAIT_S = 0.1
# Engine.run: steps in a row that produce no output while its requests wait before it says the engine is stuck
_MAX_IDLE_STEPS = 1000

log = logging.getLogger(__name__)


class Engine:
    """Thread-safe: ``add_request``, ``abort`` and ``step`` may be called from different threads."""

    def __init__(self, rt: Runtime, request_stages: Sequence[Stage], step_stages: Sequence[Stage]):
        self.rt = rt
        self.request_stages = list(request_stages)
        self.step_stages = list(step_stages)
        self.requests: dict[str, Request] = {}
        self.bus = rt.bus
        self._lock = threading.RLock()
        # Threads that want the lock from outside the step loop (abort, add_request, ...): the next step lets
        # them in before it starts, so such a call waits for the step in progress at most. An RLock is not fair:
        # a loop that steps back to back takes it again before a woken waiter runs, for as long as it steps.
        self._waiting = 0
        self._waiting_cv = threading.Condition(threading.Lock())
        self._ids = itertools.count()
        self.speculator = rt.speculator  # speculative decoding (None: off)
        self._rng = torch.Generator().manual_seed(rt.seed)  # seeds of unseeded sampling requests

    @property
    def tokenizer(self):
        return self.rt.tokenizer

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer run its model (a parallel engine that lost a rank), or None."""
        member = self.rt.parallel
        return member.driver.broken if member is not None and member.driver is not None else None

    def close(self) -> None:
        """Give back what outlives the engine object: a parallel engine's worker processes (stopped, or killed
        where they do not stop). Idempotent; an engine of one process holds nothing such."""
        member = self.rt.parallel
        if member is not None and member.driver is not None:
            member.driver.close()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The engine lock for a call that is not a step: the next step waits until this thread holds it."""
        with self._waiting_cv:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiting_cv:
                self._waiting -= 1
                if not self._waiting:
                    self._waiting_cv.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    # ---- request path -------------------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt | RequestSpec, params: SamplingParams | Mapping | None = None, **fields: Any
    ) -> Request:
        """Submit a :class:`RequestSpec` (or a prompt plus its fields, see :func:`to_spec`).

        Raises :class:`InvalidRequestError` naming the field if any request-level stage rejects it; then
        nothing of it remains (no queue entry, blocks, generator or id)."""
        spec = to_spec(prompt, params, **fields)
        try:
            ids = self.rt.tokenizer.encode(spec.prompt) if isinstance(spec.prompt, str) else list(spec.prompt)
        except TokenizerError as exc:  # text that is no Unicode text
            raise InvalidRequestError("prompt", str(exc)) from None
        req = Request(spec, ids, request_id=spec.request_id)
        bus = self.bus
        if spec.constraint is not None:  # compiled here, on the caller's thread: never under the engine lock
            try:
                req.matcher = self._start_constraint(spec)
            except Exception as exc:
                if bus.enabled:
                    bus.publish(RequestArrived(spec.request_id, spec.tenant, len(ids)))
                    bus.publish(RequestRejected(spec.request_id, spec.tenant, type(exc).__name__, str(exc), ""))
                raise
        with self._locked():
            if bus.enabled:
                bus.publish(RequestArrived(spec.request_id, spec.tenant, len(ids)))
            try:
                if spec.request_id is not None and spec.request_id in self.requests:
                    raise InvalidRequestError("request_id", f"{spec.request_id!r} is already in use")
                ctx = RequestContext(req)
                for stage in self.request_stages:
                    stage(ctx)
            except Exception as exc:
                for hold in req.holds:  # what an earlier stage took goes back: a rejection leaves nothing
                    hold.cancel()
                req.holds.clear()
                if bus.enabled:
                    bus.publish(RequestRejected(spec.request_id, spec.tenant, type(exc).__name__, str(exc),
                                                getattr(exc, "quota", "")))
                raise
            self._admit(req)
        return req

    def prepare_constraint(self, spec: RequestSpec):
        """Compile ``spec``'s constraint now (or find it in the cache): what ``add_request`` does first, for a
        caller that must not wait there (an event loop runs this on a worker thread). Raises its refusal."""
        compiler = self.rt.constraints
        if compiler is None:
            raise InvalidRequestError("constraint", "this engine was built without structured output")
        return compiler.compile(spec.constraint)

    def _start_constraint(self, spec: RequestSpec):
        matcher = self.prepare_constraint(spec).matcher()
        bitmask = torch.empty((1, bitmask_words(self.rt.model_cfg.vocab_size)), dtype=torch.int32)
        matcher.fill_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise InvalidRequestError(
                f"constraint.{spec.constraint.kind}",
                "allows no token this model's vocabulary can write as the first token of the output "
                f"(the vocabulary has {self.rt.tokenizer.vocab_size} tokens)")
        return matcher

    def _admit(self, req: Request) -> None:
        """Every request stage passed: name the request, give it what it needs to run, queue it."""
        if req.request_id is None:
            req.request_id = f"req-{next(self._ids)}"
        p = req.params
        if p.temperature > 0:
            # unseeded requests draw from the engine's own generator: a run is reproducible from cfg.seed
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
            req.generator = torch.Generator(device="cpu").manual_seed(seed)
        req.detokenizer = IncrementalDetokenizer(self.rt.tokenizer, req.prompt_ids, p.skip_special_tokens)
        if p.logprobs is not None:
            req.logprobs, req.text_offsets, req.text_ends = [], [], []
        self.requests[req.request_id] = req
        self.rt.scheduler.add(req)
        if self.bus.enabled:
            tier = req.tierset.name if req.tierset else None
            self.bus.publish(RequestAdmitted(req.request_id, req.tenant, tier, len(req.prompt_ids)))
            sel = req.selection
            if sel is not None:
                self.bus.publish(TierSelected(
                    req.request_id, req.tenant, sel.tierset.name, sel.tierset.experts_per_layer, sel.mode,
                    sel.feasible, sel.predicted.latency_ms, sel.predicted.monetary,
                ))

    # ---- step path ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step over every running request; returns the deltas it produced.

        A step always makes progress or says why: if its stages raise, the requests it held are retried one
        by one and only those that fail alone are finished with an error (``finish_reason="error"``); a
        request that can never be scheduled is finished with an error naming the blocks it needs.
        """
        self._let_waiters_in()
        with self._lock, torch.inference_mode():
            t0 = time.perf_counter()
            if self.speculator is not None:  # drafts first: the scheduler grows their KV (or drops them)
                self.speculator.propose(self.rt.scheduler.load().running)
            schedule = self.rt.scheduler.schedule()
            if not schedule:
                return self._unblock()
            outputs = self._execute(schedule)
            if self.speculator is not None:  # what the step cost, for its choice of drafts
                self.speculator.observe(len(schedule), time.perf_counter() - t0)
            self._report(schedule, t0)
            return outputs

    def _let_waiters_in(self) -> None:
        if self._waiting and not self._lock._is_owned():  # another thread waits for the lock: it goes first
            with self._waiting_cv:
                self._waiting_cv.wait_for(lambda: not self._waiting, timeout=_HANDOFF_WAIT_S)

    def _execute(self, schedule: list[tuple[Request, int]]) -> list[RequestOutput]:
        schedule.sort(key=lambda e: e[1] == 1)  # row order: prompt chunks first, then decodes
        try:
            return self._run(schedule)
        except Exception as exc:
            return self._isolate(schedule, exc)

    def _run(self, schedule: list[tuple[Request, int]]) -> list[RequestOutput]:
        """The step stages over ``schedule`` and the postprocess; if a stage raises, the requests' sampling
        and text state is put back as it was (nothing else was advanced) and the error propagates."""
        if self.speculator is not None and self.speculator.fill(schedule):
            # a draft written now may have ended early (at an end-of-sequence token): fewer tokens, row order again
            schedule = [(r, min(n, r.num_scheduled_tokens - r.num_computed)) for r, n in schedule]
            schedule.sort(key=lambda e: e[1] == 1)
        undo = [
            (r, r.generator.get_state() if r.generator is not None else None, r.detokenizer.checkpoint(),
             len(r.text), r.emitted_chars)
            for r, n in schedule
            if r.num_computed + n == r.num_scheduled_tokens  # it samples this step
        ]
        ctx = StepContext(schedule, self.rt.kv.step_layout(schedule))
        try:
            for stage in self.step_stages:
                stage(ctx)
        except Exception:
            for r, gen_state, detok, text_len, emitted in undo:
                if gen_state is not None:
                    r.generator.set_state(gen_state)
                r.detokenizer.rollback(detok)
                r.text, r.emitted_chars = r.text[:text_len], emitted
            raise
        return self._postprocess(ctx)

    def _isolate(self, schedule: list[tuple[Request, int]], exc: Exception) -> list[RequestOutput]:
        """A step raised: run each request of it alone; the ones that still fail end with the error."""
        if len(schedule) == 1:
            return [self._fail(schedule[0][0], exc)]
        outputs = []
        for entry in schedule:
            try:
                outputs += self._run([entry])
            except Exception as alone_exc:
                outputs.append(self._fail(entry[0], alone_exc))
        return outputs

    def _fail(self, req: Request, why: BaseException | str) -> RequestOutput:
        """Finish a request with an error (its blocks freed); the output carries the message and its id."""
        if isinstance(why, BaseException):
            err = InternalError(f"request {req.request_id!r} failed: {type(why).__name__}: {why}")
            log.error("%s", err, exc_info=why)
        else:
            err = InternalError(why)
            log.error("%s", err)
        self._finish(req, "error", time.monotonic())
        out = request_output(req)
        out.error, out.error_id = str(err), err.error_id
        return out

    def _unblock(self) -> list[RequestOutput]:
        """Nothing could be scheduled: if that can never change, end the request that blocks the queue."""
        blocked = self.rt.scheduler.blocked()
        if blocked is None:
            return []
        req, why = blocked
        return [self._fail(req, f"request {req.request_id!r} {why}")]

    def _postprocess(self, ctx: StepContext) -> list[RequestOutput]:
        """The bookkeeping of a step, whatever its stages did: computed tokens and KV commits for every
        scheduled entry (a speculating request's verified tokens only); for every sample, the token appended,
        the finish decided (the emit stage's, or the token limits, which always hold), finished requests freed.
        A request's samples count in order, one per token it verified (one where it had no draft)."""
        rt = self.rt
        verified = self._verify(ctx) if any(req.draft for req, _ in ctx.schedule) else None
        rt.scheduler.postprocess(verified[0] if verified is not None else ctx.schedule)
        if verified is not None:
            for req, _, _ in verified[1]:
                req.draft = []  # its kept tokens are among the samples, appended below
            if self.speculator is not None:
                self.speculator.verified(verified[1])
        multi = verified is not None  # a request may have several samples (its kept draft tokens and one more)
        emissions = getattr(ctx, "emissions", ())
        if multi:
            counts: dict[int, int] = {}
            emitted: dict[Any, Any] = {}
            for e in emissions:
                k = counts.get(id(e.request), 0)
                counts[id(e.request)] = k + 1
                emitted[(id(e.request), k)] = e
            allowed = verified[2]
        else:
            emitted = {id(e.request): e for e in emissions}
        now = time.monotonic()
        outputs: dict[int, Any] = {}  # id(request) -> its RequestOutput, or [request, delta text, delta ids]
        gap_reqs: list[Request] = []
        gaps: list[float] = []
        for req, token, logprobs in ctx.samples:
            key = id(req)
            if multi:
                out = outputs.get(key)
                k = len(out[2]) if isinstance(out, list) else 0
                if req.finished or k >= allowed.get(key, 1):
                    continue  # ended by an earlier sample, or listed more often than it verified tokens
                e = emitted.get((key, k))
            else:
                if req.finished or key in outputs:
                    continue  # a stage listed the same request twice: the first sample counted
                out = None
                e = emitted.get(key)
            reason = (e.finish_reason if e is not None else None) or req.stop_reason(
                token, rt.eos_token_ids, rt.max_model_len
            )
            if req.matcher is not None:
                if not req.matcher.accept(token):
                    outputs[key] = self._fail(req, f"request {req.request_id!r}: the sampler chose token {token}, "
                                                   "which its constraint does not allow")
                    continue
                if reason is None and req.matcher.is_terminated():
                    reason = "stop"
            req.output_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(logprobs)
            if req.text_offsets is not None:
                self._place_text(req, e)
            if req.first_token_time is None:
                req.first_token_time = now
                if self.bus.enabled:
                    self.bus.publish(FirstToken(req.request_id, now - req.arrival))
            elif self.bus.enabled and out is None:  # one gap per request and step
                gap_reqs.append(req)
                gaps.append(now - req.last_token_time)
            req.last_token_time = now
            if reason is not None:
                self._finish(req, reason, now)
            delta = e.delta_text if e is not None else ""
            if out is None:
                outputs[key] = [req, delta, [token]]
            else:
                out[1] += delta
                out[2].append(token)
        if gaps:
            self.bus.publish(TokensGenerated(
                tuple(r.request_id for r in gap_reqs), tuple(gaps), tuple(r.tenant for r in gap_reqs),
                tuple(r.tierset.name if r.tierset is not None else None for r in gap_reqs),
            ))
        return [request_output(*o) if isinstance(o, list) else o for o in outputs.values()]

    @staticmethod
    def _place_text(req: Request, e) -> None:
        """Where the new token's text starts and ends in ``req.text``; tokens whose text the detokenizer held back
        end where the next one starts (the last of them holds what came out, the others read empty)."""
        at = e.text_offset if e is not None and e.text_offset is not None else len(req.text)
        offsets, ends = req.text_offsets, req.text_ends
        k = len(ends)
        while k and ends[k - 1] is None:
            k -= 1
        for j in range(k, len(ends)):
            ends[j] = offsets[j + 1] if j + 1 < len(offsets) else at
        offsets.append(at)
        ends.append(None if e is not None and e.held else max(at, len(req.text)))

    def _verify(self, ctx: StepContext):
        """Speculative decoding's outcome: each speculating entry keeps the draft tokens the sample stage
        accepted (its samples before the last equal the draft: see the sample stage) and the KV of those only.
        Returns the schedule with the tokens each entry keeps, ``(request, drafted, accepted)`` per speculating
        entry, and how many samples of each count."""
        got: dict[int, list[int]] = {}
        for smp in ctx.samples:
            got.setdefault(id(smp.request), []).append(smp.token_id)
        kept, outcome, allowed = [], [], {}
        for req, n in ctx.schedule:
            draft = req.draft
            if not draft:
                kept.append((req, n))
                continue
            tokens = got.get(id(req), ())
            accepted = 0
            while accepted < min(len(draft), len(tokens) - 1) and tokens[accepted] == draft[accepted]:
                accepted += 1
            allowed[id(req)] = accepted + 1
            req.draft = draft[:accepted]  # what the KV commit hashes: the kept tokens (cleared once appended)
            kept.append((req, n - len(draft) + accepted))
            outcome.append((req, len(draft), accepted))
        return kept, outcome, allowed

    def _finish(self, req: Request, reason: str, now: float) -> None:
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        req.finish_time = now
        self.rt.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        req.cost = req.cost_record()
        self._settle(req)
        if self.bus.enabled:
            c = req.cost
            if c is not None:
                self.bus.publish(RequestCosted(
                    req.request_id, c.tier, req.selection.load.batch, c.predicted_latency_ms,
                    c.predicted_per_token_ms, c.latency_ms, c.per_token_ms,
                    tuple(k for k, kept in c.budget_met.items() if not kept), req.selection.correction,
                ))
            self.bus.publish(
                RequestFinished(
                    req.request_id, req.tenant, reason, len(req.prompt_ids), len(req.output_ids),
                    req.num_cached_tokens, req.tierset.name if req.tierset else None, now - req.arrival,
                )
            )

    def _settle(self, req: Request) -> None:
        """The request ended: what its request stages held for it is settled (e.g. unused quota back), and what the
        proposer kept for it goes."""
        if self.speculator is not None:
            self.speculator.release(req)
        for hold in req.holds:
            hold.settle(req)
        req.holds.clear()

    def _report(self, schedule: list[tuple[Request, int]], t0: float) -> None:
        if not (schedule and self.bus.enabled):
            return
        prefill = decode = 0
        for req, n in schedule:
            # tokens at positions before the prompt's end are prompt tokens, the rest generated ones
            prompt_part = max(0, min(n, len(req.prompt_ids) - (req.num_computed - n)))
            prefill += prompt_part
            decode += n - prompt_part
        load, pool = self.rt.scheduler.load(), self.rt.pool
        self.bus.publish(
            StepFinished(
                len(schedule), prefill, decode, time.perf_counter() - t0,
                len(load.running), len(load.waiting), pool.num_free, pool.num_blocks - pool.num_free,
                self._warm_used(), pool.num_blocks, *self._cached(), self._tenant_blocks(load.running),
            )
        )

    @staticmethod
    def _tenant_blocks(running) -> tuple[tuple[str, int], ...]:
        """(tenant, hot blocks its running requests hold) per tenant with one running."""
        held: dict[str, int] = {}
        for r in running:
            held[r.tenant] = held.get(r.tenant, 0) + len(r.block_ids)
        return tuple(held.items())

    def _cached(self) -> tuple[int, int]:
        """Blocks the prefix cache keeps that no request holds: hot, warm."""
        warm = self.rt.kv.warm
        return self.rt.pool.num_idle_cached, warm.pool.num_idle_cached if warm is not None else 0

    def _warm_used(self) -> int:
        warm = self.rt.kv.warm  # O(1): slots in use are those an allocation cannot get
        return warm.pool.num_blocks - warm.pool.num_free if warm is not None else 0

    def run(self, requests: Sequence[Request],
            on_finish: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Step until every one of ``requests`` has finished (others in flight run along); returns their final
        outputs in the order given. ``on_finish`` sees each final output as its request finishes. Steps that
        produce nothing for ``_MAX_IDLE_STEPS`` in a row while these wait raise, naming them: never a hang."""
        pending = {r.request_id for r in requests if not r.finished}
        idle = 0
        while pending:
            outs = self.step()
            idle = 0 if outs else idle + 1
            if idle > _MAX_IDLE_STEPS:
                raise InternalError(f"the engine made no progress for {idle} steps; waiting: {sorted(pending)}")
            for out in outs:
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    if on_finish is not None:
                        on_finish(out)
        return [request_output(r) for r in requests]

    # ---- control ------------------------------------------------------------------------------------
    def abort(self, request_id: str, refund: bool = False) -> RequestOutput | None:
        """Cancel a request and free all its KV blocks at once; None if it is not in flight. ``refund``: what its
        request stages took (quotas) all comes back, as for a request that never ran, whatever it computed (a
        choice of an API request that a sibling's refusal fails: the client is charged nothing)."""
        with self._locked():
            req = self.requests.pop(request_id, None)
            if req is None:
                return None
            req.finish_reason = "abort"
            self.rt.scheduler.finish(req)
            req.status = RequestStatus.FINISHED
            if refund:
                for hold in req.holds:
                    hold.cancel()
            self._settle(req)
            if self.bus.enabled:
                load, pool = self.rt.scheduler.load(), self.rt.pool
                self.bus.publish(RequestAborted(
                    req.request_id, req.tenant, len(req.output_ids), len(load.running), len(load.waiting),
                    pool.num_blocks - pool.num_free, self._warm_used(), pool.num_blocks, *self._cached(),
                    self._tenant_blocks(load.running),
                ))
            return request_output(req)

    def end_session(self, session_id: str) -> bool:
        """Release a session's pinned KV now (it also expires after ``cache.session_ttl_s``)."""
        with self._locked():
            return self.rt.kv.end_session(session_id)

    def has_unfinished(self) -> bool:
        with self._locked():
            return self.rt.scheduler.has_unfinished()
