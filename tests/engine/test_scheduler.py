"""Schedulers (registry kind ``scheduler``): per step ``{request: tokens}`` under the token and sequence
budgets, preemption when blocks run out, fcfs vs priority order; events go to the bus."""

from __future__ import annotations

import pytest
from hf_models import random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.kv_cache_manager import KVCacheManager
from litellm_pipeline.engine.request import Request, RequestStatus
from litellm_pipeline.engine.scheduler import FcfsScheduler, PriorityScheduler
from litellm_pipeline.request_spec import RequestSpec
from litellm_pipeline.telemetry import (
    EventBus,
    MemorySink,
    RequestPreempted,
    RequestScheduled,
)

BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_req(n: int, name: str, priority: int = 0) -> Request:
    r = Request(RequestSpec(tuple(range(1, n + 1)), priority=priority), list(range(1, n + 1)))
    r.request_id = name
    return r


def scheduler(cls=FcfsScheduler, num_blocks=16, max_seqs=8, max_tokens=64, preemption="recompute"):
    sink = MemorySink()
    bus = EventBus([sink])
    kv = KVCacheManager(BlockPool(num_blocks), [], BS, prefix_caching=False, bus=bus)
    return cls(kv, max_seqs, max_tokens, preemption, bus=bus), sink


def advance(plan) -> None:
    """What the engine's postprocess does for the scheduler: computed tokens, one new token when caught up."""
    for req, n in plan:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.output_ids.append(7)


def test_token_budget_splits_a_long_prompt_into_chunks():
    s, sink = scheduler(max_tokens=10)
    a, b = make_req(25, "a"), make_req(3, "b")
    s.add(a)
    s.add(b)
    plans = []
    for _ in range(4):
        plan = s.schedule()
        plans.append([(r.request_id, n) for r, n in plan])
        advance(plan)
    assert plans[0] == [("a", 10)]
    assert plans[1] == [("a", 10)]
    assert plans[2] == [("a", 5), ("b", 3)]  # a's last chunk leaves room for b's whole prompt
    assert plans[3] == [("a", 1), ("b", 1)]  # both generate
    assert [e.request_id for e in sink.of(RequestScheduled)] == ["a", "b"]


def test_max_num_seqs_bounds_the_running_set():
    s, _ = scheduler(max_seqs=2)
    reqs = [make_req(2, f"r{i}") for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert [r.request_id for r, _ in plan] == ["r0", "r1"] and len(s.waiting) == 1
    s.finish(reqs[0])
    advance(plan)
    assert [r.request_id for r, _ in s.schedule()] == ["r1", "r2"]


@pytest.mark.parametrize(
    "cls, names, priorities, victim",
    [(FcfsScheduler, ("old", "new"), (0, 0), "new"), (PriorityScheduler, ("low", "high"), (9, 0), "low")],
)
def test_out_of_blocks_preempts_the_least_important_and_publishes_it(cls, names, priorities, victim):
    s, sink = scheduler(cls, num_blocks=4)
    reqs = {n: make_req(7, n, priority=p) for n, p in zip(names, priorities)}
    for r in reqs.values():
        s.add(r)
    advance(s.schedule())  # both prompts: 2 blocks each, the whole pool
    advance(s.schedule())  # the 8th token still fits each one's 2nd block
    plan = s.schedule()  # the 9th needs a 3rd block each: one request must give way
    (e,) = sink.of(RequestPreempted)
    assert e.request_id == victim and e.mode == "recompute"
    preempted = reqs[victim]
    assert preempted.status is RequestStatus.WAITING and preempted.num_computed == 0 and not preempted.block_ids
    assert [r.request_id for r, _ in plan] == [n for n in names if n != victim]
    assert s.waiting[0] is preempted


def test_priority_scheduler_serves_lower_values_first(hf_checkpoint):
    ckpt = str(hf_checkpoint("mixtral"))
    llm = LLM(model=ckpt, max_num_seqs=1, **{"engine.scheduler": "priority"})
    prompts = random_prompts((6, 6, 6), seed=17)
    ids = [llm.engine.add_request(p, GREEDY, priority=prio).request_id for p, prio in zip(prompts, (5, 0, 2))]
    order = []
    while llm.engine.has_unfinished():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    assert order == [ids[1], ids[2], ids[0]]
    fcfs = LLM(model=ckpt, max_num_seqs=1)
    ids = [fcfs.engine.add_request(p, GREEDY, priority=prio).request_id for p, prio in zip(prompts, (5, 0, 2))]
    order = []
    while fcfs.engine.has_unfinished():
        order += [o.request_id for o in fcfs.engine.step() if o.finished]
    assert order == ids
