"""Tenants' KV shares: ``max_kv_fraction`` caps the hot blocks a tenant's running requests hold (its own requests
give way, another tenant's start instead), ``min_kv_fraction`` is guaranteed (never preempted for a tenant above
its own; a waiting request within it reclaims blocks from such a tenant). Outputs stay exactly what each request
gives alone, under every scheduler, and every block comes back."""

from __future__ import annotations

import pytest
from _engine_util import assert_pool_empty, greedy

from litellm_pipeline import LLM
from litellm_pipeline.errors import ConfigError

# the demo model's contexts are 64 tokens: 16 blocks of 4 hold 64 tokens in all
POOL = ["+recipe=generate", "device.threads=1", "cache.block_size=4", "cache.num_blocks=16",
        "cache.enable_prefix_caching=false", "engine.max_num_seqs=8"]
LONG = "copy:abcdefgh12345678abcdefgh="  # 31 tokens with BOS: 8 blocks, answer 16+
SHORT = "12+345="


def build(scheduler: str, *tenants: str) -> LLM:
    return LLM(overrides=[*POOL, f"engine.scheduler={scheduler}", *tenants])


def held(llm: LLM) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in llm.engine.rt.scheduler.running:
        out[r.tenant] = out.get(r.tenant, 0) + len(r.block_ids)
    return out


def running_of(llm: LLM, tenant: str) -> int:
    return sum(r.tenant == tenant for r in llm.engine.rt.scheduler.running)


def alone_outputs(prompts: list[str], params) -> list[list[int]]:
    ref = LLM(overrides=POOL)
    return [ref.generate(p, params)[0].token_ids for p in prompts]


def run(llm: LLM, reqs: list[tuple[str, str, str]], params, check=lambda llm: None) -> dict[str, list[int]]:
    eng = llm.engine
    for rid, tenant, prompt in reqs:
        eng.add_request(prompt, params, tenant=tenant, request_id=rid)
    outs: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        check(llm)
        steps += 1
        assert steps < 2000
    assert_pool_empty(llm)
    return outs


@pytest.mark.parametrize("scheduler", ["fcfs", "fair", "priority"])
def test_a_cap_keeps_a_flood_within_its_share_and_lets_the_other_tenant_in(scheduler):
    llm = build(scheduler, "+tenants.a.max_kv_fraction=0.5")
    sched = llm.engine.rt.scheduler
    assert sched.shares["a"].max_blocks == 8
    params = greedy(12)
    reqs = [(f"a{i}", "a", LONG) for i in range(4)] + [("b0", "b", SHORT)]

    def within(llm):
        h = held(llm)
        assert h.get("a", 0) <= 8 or running_of(llm, "a") == 1, h  # only a's lone request may pass its cap

    started: dict[str, int] = {}
    orig = sched.schedule

    def schedule():
        plan = orig()
        for r, _ in plan:
            started.setdefault(r.request_id, len(started))
        return plan

    sched.schedule = schedule
    outs = run(llm, reqs, params, within)
    # b's request starts with the first of a's: a's others wait behind the cap, not in front of b
    assert started["b0"] <= 1, started
    want = dict(zip(["a", "b"], alone_outputs([LONG, SHORT], params)))
    assert all(outs[rid] == want[t] for rid, t, _ in reqs)


def test_without_a_cap_the_flood_takes_the_pool_and_the_other_tenant_waits():
    """The same load with no share: a's requests fill the pool (b's request starts only after a's first ones),
    which is what the cap prevents."""
    llm = build("fcfs")
    sched = llm.engine.rt.scheduler
    order: list[str] = []
    orig = sched.schedule

    def schedule():
        plan = orig()
        for r, _ in plan:
            if r.request_id not in order:
                order.append(r.request_id)
        return plan

    sched.schedule = schedule
    run(llm, [(f"a{i}", "a", LONG) for i in range(4)] + [("b0", "b", SHORT)], greedy(12))
    assert order.index("b0") >= 2


def _b_starts_after(llm: LLM, a_params, fill: int, steps: int) -> tuple[bool, list[str]]:
    """a's requests run ``fill`` steps; then b sends two short ones: are both running ``steps`` steps later, and
    whose requests were preempted in those steps."""
    eng, sched = llm.engine, llm.engine.rt.scheduler
    preempted: list[str] = []
    orig = sched.preempt

    def preempt(req):
        preempted.append(req.tenant)
        orig(req)

    for _ in range(fill):
        eng.step()
    sched.preempt = preempt
    for i in range(2):
        eng.add_request(SHORT, greedy(24), tenant="b", request_id=f"b{i}")
    for _ in range(steps):
        eng.step()
    started = {"b0", "b1"} <= {r.request_id for r in sched.running}
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        if held(llm).get("b", 0) <= (sched.shares["b"].min_blocks if "b" in sched.shares else -1):
            assert "b" not in preempted  # within its guarantee: never a victim
    want = alone_outputs([SHORT], greedy(24))[0]
    assert outs["b0"] == outs["b1"] == want
    assert_pool_empty(llm)
    return started, preempted


@pytest.mark.parametrize("scheduler", ["fcfs", "fair"])
def test_a_guaranteed_tenant_does_not_wait_behind_a_request_that_does_not_fit(scheduler):
    """a's second long request cannot start in the blocks its first one leaves: without a guarantee b's requests
    wait behind it (first come, first served); with one, they start in those blocks."""
    for guarantee, want in ((False, False), (True, True)):
        llm = build(scheduler, *(["+tenants.b.min_kv_fraction=0.5"] if guarantee else ["+tenants.b.weight=1"]))
        for i in range(3):
            llm.engine.add_request(LONG, greedy(24), tenant="a", request_id=f"a{i}")
        started, _ = _b_starts_after(llm, greedy(24), fill=3, steps=2)
        assert started == want, (scheduler, guarantee)


def test_a_guaranteed_tenant_reclaims_blocks_from_a_tenant_above_its_own():
    """a's one request holds the whole pool: b's requests, within b's guarantee, preempt it to start; without
    the guarantee they wait for it to end."""
    for guarantee in (False, True):
        llm = build("fcfs", *(["+tenants.b.min_kv_fraction=0.5"] if guarantee else []))
        llm.engine.add_request(LONG, greedy(32), tenant="a", request_id="a0")
        started, preempted = _b_starts_after(llm, greedy(32), fill=30, steps=1)
        assert started == guarantee and (preempted == ["a"]) == guarantee, preempted


def test_victims_by_share_class_then_the_schedulers_order():
    """Over its cap first (even the oldest request), then above its guarantee, last in order; a tenant within its
    guarantee is never the victim of one above its own: that one waits (preempts itself)."""
    from litellm_pipeline.engine.request import Request
    from litellm_pipeline.request_spec import RequestSpec

    def fake(tenant: str, blocks: int, rid: str) -> Request:
        r = Request(RequestSpec([5] * 8, tenant=tenant), [5] * 8, request_id=rid)
        r.block_ids = list(range(blocks))
        return r

    def victims(*tenants: str) -> list[str]:
        sched = build("fcfs", *tenants).engine.rt.scheduler
        sched.running = [fake("a", 6, "a0"), fake("b", 2, "b0"), fake("b", 2, "b1")]
        sched._count_held()
        return [sched._victim_for(r).request_id for r in sched.running]

    assert victims() == ["b1", "b1", "b1"]  # no shares: the newest
    assert victims("+tenants.a.max_kv_fraction=0.25") == ["a0", "a0", "a0"]  # a holds 6 > 4 blocks
    assert victims("+tenants.b.min_kv_fraction=0.5") == ["a0", "a0", "a0"]  # b within 8: a0 gives way to b
    assert victims("+tenants.a.min_kv_fraction=0.5") == ["b1", "b1", "b1"]  # a within its guarantee


def test_shares_are_checked():
    with pytest.raises(ConfigError, match="min_kv_fraction"):
        build("fcfs", "+tenants.a.min_kv_fraction=0.6", "+tenants.b.min_kv_fraction=0.6")
    with pytest.raises(ConfigError, match="min_kv_fraction.*must not exceed max_kv_fraction"):
        build("fcfs", "+tenants.a.min_kv_fraction=0.6", "+tenants.a.max_kv_fraction=0.5")
    with pytest.raises(ConfigError, match="max_kv_fraction"):
        build("fcfs", "+tenants.a.max_kv_fraction=1.5")


@pytest.mark.parametrize("scheduler", ["fcfs", "fair"])
def test_fault_suite_with_kv_shares(monkeypatch, scheduler):
    """The randomized fault suite (tiny pools, aborts, preemption by swap and recompute, sessions, failing stages,
    invalid submissions from several tenants) with a cap on one tenant and a guarantee on another: nothing leaks
    or hangs, every request ends once with exactly its tokens alone."""
    from litellm_pipeline.tasks import faults as fault_suite

    drawn = fault_suite.random_engine_config
    shares = {"tenants.t2.max_kv_fraction": 0.4, "tenants.faulty-1.min_kv_fraction": 0.3, "tenants.t9.weight": 1}
    monkeypatch.setattr(fault_suite, "random_engine_config",
                        lambda rng, need: {**drawn(rng, need), "engine.scheduler": scheduler, **shares})
    r = fault_suite.run_fault_suite(fault_suite.FaultSettings(seed=2, runs=4, ops=60, progress=False))
    assert r["failures"] == []
    assert r["admitted"] > 50 and r["preemptions"] > 0, r
