"""The randomized fault suite behind ``+recipe=faults``: random interleavings of everything a client can do,
against randomly sized tiny engines, with invariants checked after every run.

Each run draws an engine (block size, a pool a few requests fill, swap or recompute preemption, a warm tier or
none, prefix caching on or off, fcfs or priority, LRU or LFU, small step budgets) with an extra stage that
raises for marked requests, then a sequence of operations: valid and invalid submissions, steps, aborts,
streams left early, session turns and session ends. After the run is drained it checks:

* no hang: the work finishes within ``max_steps`` steps;
* every admitted request ends exactly once; an invalid submission raises ``InvalidRequestError`` and changes
  nothing;
* the KV pool (and the warm pool) is empty with every reference count zero once sessions end;
* every request that was neither faulted nor aborted produced exactly the tokens it produces alone on an
  unconstrained engine.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from litellm_pipeline.errors import InvalidRequestError, section_settings
from litellm_pipeline.request_spec import RequestSpec
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.stages.base import Stage, StepContext
from litellm_pipeline.telemetry import MemorySink

MARK = "faulty-"  # tenant prefix of requests the injected stage fails: "faulty-3" fails after 3 output tokens
VOCAB_LOW = 3  # the demo tokenizer's special tokens come first


class FaultSettings(BaseModel):
    """The ``faults:`` section of ``+recipe=faults``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    runs: int = Field(default=20, ge=1)
    ops: int = Field(default=60, ge=1)  # operations per run (steps included)
    max_steps: int = Field(default=5000, ge=10)  # per run: more than this is a hang
    progress: bool = True


def fault_settings(section: Any) -> FaultSettings:
    return section_settings(FaultSettings, section, "faults")


class FaultInjector(Stage):
    """A step stage that raises whenever a marked request (tenant ``faulty-K``) with K or more output tokens is
    in the step: the engine must fail that request alone and keep the others going."""

    inputs = ("samples",)
    outputs = ("samples",)

    def __call__(self, ctx: StepContext) -> None:
        for req, _ in ctx.schedule:
            if req.tenant.startswith(MARK) and len(req.output_ids) >= int(req.tenant[len(MARK):]):
                raise RuntimeError(f"injected fault in request {req.request_id}")


class _RunAborted(Exception):
    """A step raised: the run ends there (after its requests are aborted and the invariants checked)."""


@dataclass
class Track:
    spec: RequestSpec
    finals: list = field(default_factory=list)
    deltas: int = 0
    abort_after_delta: bool = False  # a stream whose consumer leaves after its next delta
    aborted: bool = False


@dataclass
class RunReport:
    config: dict
    admitted: int = 0
    invalid: int = 0
    aborted: int = 0
    faulted: int = 0
    session_turns: int = 0
    steps: int = 0
    preemptions: int = 0
    failures: list[str] = field(default_factory=list)


def random_engine_config(rng: random.Random, max_need_tokens: int) -> dict:
    bs = rng.choice([2, 4, 8])
    need = -(-max_need_tokens // bs)
    return {
        "cache.block_size": bs,
        "cache.num_blocks": rng.randint(need, need + need // 2),  # a few requests fill it
        "engine.preemption": rng.choice(["recompute", "swap"]),
        "cache.warm_blocks": rng.choice([0, 8, 32]),
        "cache.enable_prefix_caching": rng.random() < 0.7,
        "engine.max_num_seqs": rng.randint(1, 8),
        "engine.max_num_batched_tokens": rng.choice([4, 8, 16, 64]),
        "engine.scheduler": rng.choice(["fcfs", "priority"]),
        "cache.kv_policy": rng.choice(["lru", "lfu"]),
    }


class FaultRun:
    """One random run against one engine; ``reference(spec)`` gives a request's tokens when run alone."""

    MAX_PROMPT, MAX_TOKENS, TURN_EXTRA, MAX_TURN_PROMPT = 12, 20, 3, 36

    def __init__(self, llm, rng: random.Random, reference: Callable[[RequestSpec], list[int]], report: RunReport):
        self.llm, self.engine, self.rng, self.reference, self.report = llm, llm.engine, rng, reference, report
        self.vocab = self.engine.rt.model_cfg.vocab_size
        self.events = MemorySink()
        self.engine.bus.subscribe(self.events)
        self.tracks: dict[str, Track] = {}
        self.sessions: dict[str, Track] = {}  # session id -> its last turn
        self.next_id = 0

    # ---- operations
    def _params(self) -> SamplingParams:
        r = self.rng
        kw: dict[str, Any] = {"max_tokens": r.randint(1, self.MAX_TOKENS) if r.random() < 0.3 else self.MAX_TOKENS,
                              "ignore_eos": r.random() < 0.85}
        if r.random() < 0.5:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=r.choice([0.7, 1.0, 1.3]), seed=r.randrange(1000), top_k=r.choice([0, 5]))
        if r.random() < 0.2:
            kw["stop"] = [r.choice("0123456789abc=")]
        return SamplingParams(**kw)

    def _submit(self, prompt: list[int], **fields) -> None:
        rid = f"f{self.next_id}"
        self.next_id += 1
        spec = RequestSpec(prompt, self._params(), request_id=rid, priority=self.rng.randint(0, 3), **fields)
        self.engine.add_request(spec)
        self.tracks[rid] = Track(spec)
        self.report.admitted += 1
        if spec.tenant.startswith(MARK):
            self.report.faulted += 1

    def add_valid(self) -> None:
        n = self.rng.randint(1, self.MAX_PROMPT)
        prompt = [self.rng.randrange(VOCAB_LOW, self.vocab) for _ in range(n)]
        tenant = f"{MARK}{self.rng.randint(0, 4)}" if self.rng.random() < 0.15 else self.rng.choice(["", "", "t2"])
        session = f"s{self.next_id}" if self.rng.random() < 0.25 else None
        self._submit(prompt, tenant=tenant, session_id=session)

    def session_turn(self) -> None:
        done = [(sid, t) for sid, t in self.sessions.items() if t.finals and t.finals[-1].finish_reason != "error"]
        if not done:
            return self.add_valid()
        sid, last = self.rng.choice(done)
        prev = list(last.spec.prompt) + list(last.finals[-1].token_ids)
        extra = [self.rng.randrange(VOCAB_LOW, self.vocab) for _ in range(self.rng.randint(1, self.TURN_EXTRA))]
        del self.sessions[sid]
        if len(prev) + len(extra) > self.MAX_TURN_PROMPT:  # the conversation is over: its KV may go
            self.engine.end_session(sid)
            return self.add_valid()
        self._submit(prev + extra, tenant=last.spec.tenant, session_id=sid)
        self.report.session_turns += 1

    def add_invalid(self) -> None:
        eng, r = self.engine, self.rng
        before = self._state()
        bad: list[Callable[[], Any]] = [
            lambda: eng.add_request([], SamplingParams()),
            lambda: eng.add_request([self.vocab + 5], SamplingParams()),
            lambda: eng.add_request(list(range(VOCAB_LOW, VOCAB_LOW + 3)) * 40, SamplingParams()),
            lambda: eng.add_request([5, 6], {"nonsense": 1}),
            lambda: eng.add_request([5, 6], SamplingParams(), tier="no-such-tier"),
            lambda: eng.add_request([1.5, 6]),
            lambda: eng.add_request({"prompt": "x"}),
            lambda: eng.add_request([5], {"temperature": -1}),
            lambda: eng.add_request([5], SamplingParams.model_construct(logprobs=1000)),
            lambda: eng.add_request([5], SamplingParams(), session_id=["chat"]),
        ]
        live = [rid for rid, t in self.tracks.items() if not t.finals]
        if live:  # an id still in flight
            bad.append(lambda: eng.add_request([5], SamplingParams(), request_id=r.choice(live)))
        i = r.randrange(len(bad))
        try:
            bad[i]()
        except InvalidRequestError:
            pass
        else:
            self.report.failures.append(f"invalid submission #{i} was accepted")
        if self._state() != before:
            self.report.failures.append(f"invalid submission #{i} changed the engine state")
        self.report.invalid += 1

    def steps(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            self.step()

    def step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as exc:  # the engine must never raise from a step: record it, end the run
            self.report.failures.append(f"step raised {type(exc).__name__}: {exc}")
            raise _RunAborted from exc
        for out in outs:
            t = self.tracks.get(out.request_id)
            if t is None:
                self.report.failures.append(f"output for unknown request {out.request_id}")
                continue
            t.deltas += 1
            if out.finished:
                t.finals.append(out)
                if t.spec.session_id is not None:
                    self.sessions[t.spec.session_id] = t
            elif t.abort_after_delta:
                self._abort(out.request_id)
        self.report.steps += 1

    def _abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        if out is not None:
            self.tracks[rid].finals.append(out)
            self.tracks[rid].aborted = True
            self.report.aborted += 1

    def abort(self) -> None:
        live = [rid for rid, t in self.tracks.items() if not t.finals]
        if live:
            self._abort(self.rng.choice(live))

    def stream_break(self) -> None:
        live = [t for t in self.tracks.values() if not t.finals]
        if live:
            self.rng.choice(live).abort_after_delta = True

    def end_session(self) -> None:
        if self.sessions:
            sid = self.rng.choice(sorted(self.sessions))
            self.engine.end_session(sid)
            del self.sessions[sid]

    # ---- checks
    def _state(self) -> tuple:
        sched = self.engine.rt.scheduler.load()
        return len(self.engine.requests), len(sched.waiting), len(sched.running), self.engine.rt.pool.num_free

    def run(self, num_ops: int, max_steps: int) -> None:
        ops = [(self.add_valid, 30), (self.steps, 35), (self.add_invalid, 8), (self.abort, 5),
               (self.stream_break, 5), (self.session_turn, 10), (self.end_session, 4)]
        fns, weights = zip(*ops)
        try:
            for _ in range(num_ops):
                self.rng.choices(fns, weights)[0]()
            steps = 0
            while self.engine.has_unfinished():
                self.step()
                steps += 1
                if steps > max_steps:
                    self.report.failures.append(f"hang: work left after {max_steps} steps ({self._state()})")
                    break
        except _RunAborted:
            pass
        for rid in list(self.engine.requests):  # after a hang or a raise: what is left must still be freeable
            self._abort(rid)
        for sid in list(self.engine.rt.kv.sessions):
            self.engine.end_session(sid)
        self.report.preemptions = self.events.counts["preempted"]
        self.check()

    def check(self) -> None:
        fail = self.report.failures.append
        pool = self.engine.rt.pool
        if not pool.is_empty() or any(pool.ref_counts):
            fail(f"KV pool not empty after the run: {pool.num_blocks - pool.num_free} blocks held")
        warm = self.engine.rt.kv.warm
        if warm is not None and not warm.pool.is_empty():
            fail(f"warm pool not empty after the run: {warm.num_held} slots held")
        if self.engine.requests:
            fail(f"requests left in the engine: {sorted(self.engine.requests)}")
        for rid, t in self.tracks.items():
            if len(t.finals) != 1:
                fail(f"{rid} ended {len(t.finals)} times")
                continue
            out = t.finals[0]
            if t.aborted:
                continue
            faulty = t.spec.tenant.startswith(MARK)
            if out.finish_reason == "error":
                if not faulty:
                    fail(f"{rid} (not faulted) failed: {out.error}")
                continue
            if faulty and len(out.token_ids) > int(t.spec.tenant[len(MARK):]):
                fail(f"{rid} was to fail after {t.spec.tenant[len(MARK):]} tokens but made {len(out.token_ids)}")
            ref = self.reference(t.spec)
            if out.token_ids != ref:
                fail(f"{rid} tokens {out.token_ids} differ from alone {ref} (spec {t.spec})")


def run_fault_suite(s: FaultSettings, model: str | None = None, log: Callable[[str], None] = print) -> dict:
    """Run ``s.runs`` random runs; returns totals and every invariant violation found."""

    rng = random.Random(s.seed)
    engine_log = logging.getLogger("litellm_pipeline.engine.engine")
    quiet = engine_log.level
    engine_log.setLevel(logging.CRITICAL)  # injected faults are expected: their tracebacks are noise here
    try:
        return _run_all(s, model, rng, log)
    finally:
        engine_log.setLevel(quiet)


def _run_all(s: FaultSettings, model: str | None, rng: random.Random, log: Callable[[str], None]) -> dict:
    from litellm_pipeline import LLM

    ref_llm = LLM(model=model, dtype="float32")
    ref_cache: dict[tuple, list[int]] = {}

    def reference(spec: RequestSpec) -> list[int]:
        key = (spec.prompt, spec.params.model_dump_json())
        if key not in ref_cache:
            ref_cache[key] = ref_llm.generate(spec.replace(tenant="", session_id=None, request_id=None))[0].token_ids
        return ref_cache[key]

    max_need = FaultRun.MAX_TURN_PROMPT + FaultRun.MAX_TOKENS
    reports = []
    t0 = time.perf_counter()
    for i in range(s.runs):
        cfg = random_engine_config(rng, max_need)
        llm = LLM(
            model=model, dtype="float32",
            overrides=["+pipeline.stages.faults={impl: 'litellm_pipeline.tasks.faults:FaultInjector', params: {}}",
                       "pipeline.order=[admit,select_tier,route,prefill,decode,sample,faults,emit]"],
            **cfg,
        )
        report = RunReport(cfg)
        FaultRun(llm, random.Random(rng.randrange(2**32)), reference, report).run(s.ops, s.max_steps)
        reports.append(report)
        if s.progress:
            log(f"run {i + 1}/{s.runs}: {report.admitted} admitted, {report.invalid} invalid, {report.aborted} aborted, "
                f"{report.faulted} faulted, {report.session_turns} session turns, {report.preemptions} preemptions, "
                f"{report.steps} steps, {len(report.failures)} failures")
        for f in report.failures:
            log(f"  FAIL: {f}  (engine {cfg})")
    keys = ("admitted", "invalid", "aborted", "faulted", "session_turns", "preemptions", "steps")
    total = {k: sum(getattr(r, k) for r in reports) for k in keys}
    failures = [f"run {i}: {f}" for i, r in enumerate(reports) for f in r.failures]
    return {"runs": s.runs, "seed": s.seed, **total, "failures": failures, "seconds": time.perf_counter() - t0}


def run(cfg) -> dict:
    """The randomized fault suite over the ``faults`` section; writes faults.json and exits 1 if an invariant
    broke."""
    import sys

    from litellm_pipeline.config.build import to_plain
    from litellm_pipeline.tasks import write_json

    plain = to_plain(cfg)
    result = run_fault_suite(fault_settings(plain.get("faults")), plain["model"].get("path"))
    path = write_json(result, "faults.json")
    print(
        f"{result['runs']} runs (seed {result['seed']}): {result['admitted']} requests admitted, {result['invalid']} "
        f"invalid submissions refused, {result['aborted']} aborted, {result['faulted']} faulted, "
        f"{result['session_turns']} session turns, {result['preemptions']} preemptions, {result['steps']} steps, "
        f"{result['seconds']:.0f} s; {len(result['failures'])} invariant violations; wrote {path}"
    )
    if result["failures"]:
        sys.exit(1)
    return result
