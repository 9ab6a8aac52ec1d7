"""check_scheduler: a ``scheduler`` class driving the demo model on tiny pools, with preemption and aborts.

The contract (``litellm_pipeline/engine/scheduler.py``): a class built as ``cls(kv, max_num_seqs,
max_num_batched_tokens, preemption, bus=bus)`` (plus ``weights=`` if it takes them) with ``add(req)``, ``schedule()
-> [(request, num_new_tokens), ...]``, ``postprocess(plan)``, ``finish(req)``, ``load()``, ``has_unfinished()`` and
``blocked()``. Subclassing ``FcfsScheduler`` and changing the order is the easy way. Every plan must:

* hold each request at most once, none finished or still swapped out, each with ``1 <= n <=`` its tokens left;
* stay within ``max_num_batched_tokens`` and ``max_num_seqs``;
* have grown the request's KV blocks for those tokens (``len(block_ids) * block_size >= num_computed + n``).

Over a whole workload every request must finish, with the tokens it gets from ``fcfs`` on a roomy pool (a
preempted request resumes where it was), and the pool must end empty.
"""

from __future__ import annotations

from typing import Any, Sequence

from litellm_pipeline.telemetry import MemorySink
from litellm_pipeline.testing._support import (
    DEMO_PROMPTS,
    assert_drained,
    build_llm,
    config_name,
    describe,
    resolve,
    run_to_completion,
)

TIGHT = ("cache.block_size=4", "cache.num_blocks=10", "engine.max_num_seqs=4", "engine.max_num_batched_tokens=16")


def _watch_plans(llm, name: str) -> list[int]:
    """Wrap the engine's scheduler so every plan is checked against the invariants above; returns step sizes."""
    sched = llm.engine.rt.scheduler
    # the limits as configured, not as the scheduler may have rewritten them
    bs, max_tokens, max_seqs = llm.engine.rt.block_size, llm.cfg.engine.max_num_batched_tokens, llm.cfg.engine.max_num_seqs
    original = sched.schedule
    sizes: list[int] = []

    def schedule():
        plan = original()
        assert isinstance(plan, list), f"scheduler {name}: schedule() returned {type(plan).__name__}, not a list"
        seen = set()
        for entry in plan:
            req, n = entry
            what = f"scheduler {name}: request {req.request_id} scheduled for {n} tokens"
            assert id(req) not in seen, f"{what} twice in one step"
            seen.add(id(req))
            assert not req.finished, f"{what} after it finished"
            assert req.swapped_slots is None, f"{what} while its KV is swapped out"
            left = req.num_tokens - req.num_computed
            assert isinstance(n, int) and 1 <= n <= left, f"{what}, but it has {left} tokens left to compute"
            assert len(req.block_ids) * bs >= req.num_computed + n, (
                f"{what} at position {req.num_computed}, but it holds only {len(req.block_ids)} blocks of {bs}"
            )
        total = sum(n for _, n in plan)
        assert total <= max_tokens, f"scheduler {name}: a step of {total} tokens (max_num_batched_tokens {max_tokens})"
        assert len(plan) <= max_seqs, f"scheduler {name}: a step of {len(plan)} requests (max_num_seqs {max_seqs})"
        sizes.append(total)
        return plan

    sched.schedule = schedule
    return sizes


def _workload(llm, prompts: Sequence[str], max_tokens: int, abort: bool) -> tuple[list, str | None]:
    """Requests of two tenants and mixed priorities, half of them arriving while the others run; optionally one
    aborted midway. Returns the requests and the aborted one's id."""
    from litellm_pipeline.sampling import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    fields = [dict(tenant=("a", "b")[i % 2], priority=(i * 7) % 3) for i in range(len(prompts))]
    half = len(prompts) // 2
    reqs = [engine.add_request(p, params, **f) for p, f in zip(prompts[:half], fields[:half])]
    for _ in range(3):
        engine.step()
    reqs += [engine.add_request(p, params, **f) for p, f in zip(prompts[half:], fields[half:])]
    aborted = None
    if abort:
        engine.step()
        victim = next((r for r in reqs if not r.finished), None)
        if victim is not None:
            aborted = victim.request_id
            engine.abort(aborted)
    return reqs, aborted


def check_scheduler(impl: str | type, *, prompts: Sequence[str] = DEMO_PROMPTS * 2, max_tokens: int = 10,
                    overrides: Sequence[str] = (), max_steps: int = 3000) -> dict[str, int]:
    """Check a ``scheduler`` class (a registry name or the class) on the demo model.

    The workload (two tenants, mixed priorities, late arrivals) runs on a roomy ``fcfs`` engine for reference, then
    with the checked scheduler on a 10-block pool of 4-token blocks, 4 sequences and 16 tokens per step: once with
    ``recompute`` preemption, once with ``swap`` into a warm tier, and once with a request aborted midway. Every plan
    is checked (see the module doc); every request must finish within ``max_steps`` steps with the reference's
    tokens, and the pool must end empty. Returns the preemptions seen per run.
    """
    resolve("scheduler", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    ref_llm = build_llm(list(overrides))
    ref_reqs, _ = _workload(ref_llm, prompts, max_tokens, abort=False)
    run_to_completion(ref_llm.engine, ref_reqs, max_steps, "the fcfs reference run")
    reference = [r.output_ids for r in ref_reqs]
    out: dict[str, Any] = {}
    with config_name("scheduler", impl) as cfg:
        runs = (("recompute", ("engine.preemption=recompute",), False),
                ("swap", ("engine.preemption=swap", "cache.warm_blocks=16"), False),
                ("abort", ("engine.preemption=recompute",), True))
        for label, extra, abort in runs:
            llm = build_llm([*overrides, f"engine.scheduler={cfg}", *TIGHT, *extra])
            sink = MemorySink()
            llm.engine.bus.subscribe(sink)
            _watch_plans(llm, name)
            what = f"scheduler {name} ({label} run)"
            reqs, aborted = _workload(llm, prompts, max_tokens, abort)
            run_to_completion(llm.engine, reqs, max_steps, what)
            for p, r, want in zip(prompts, reqs, reference):
                if r.request_id == aborted:
                    assert r.finish_reason == "abort", f"{what}: aborted request ended with {r.finish_reason!r}"
                    continue
                assert r.finish_reason == "length" and r.output_ids == want, (
                    f"{what}: {p!r} ended {r.finish_reason!r} with {r.output_ids}; with fcfs on a roomy pool it "
                    f"gives {want} (a preempted request must resume exactly where it was)"
                )
            assert_drained(llm, what)
            out[label] = sink.counts["preempted"]
    return out
