"""The ``fair`` scheduler: weighted fair queuing across tenants decides which waiting request joins the batch.

The FairQueue is tested alone (exact admission orders by weight, idle tenants re-entering without banked credit,
preempted requests refunded, aborts), then inside the engine: a flood from one tenant does not hold another's
request back, where fcfs does."""

from __future__ import annotations

import pytest
from _engine_util import assert_pool_empty, greedy, record_schedules

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.engine.fair_scheduler import FairQueue, FairScheduler
from litellm_pipeline.engine.request import Request
from litellm_pipeline.request_spec import RequestSpec


def req(tenant: str, prompt_len: int = 4, max_tokens: int = 4) -> Request:
    """A request of ``prompt_len + max_tokens`` tokens of work (its charge is that over its tenant's weight)."""
    ids = list(range(1, prompt_len + 1))
    return Request(RequestSpec(ids, SamplingParams(max_tokens=max_tokens), tenant=tenant), ids)


def drain(q: FairQueue, n: int | None = None) -> list[str]:
    """Tenants of the next ``n`` admissions (all by default); ``[0]`` must always be what ``popleft`` takes."""
    out = []
    while q and (n is None or len(out) < n):
        head = q[0]
        got = q.popleft()
        assert got is head
        out.append(got.tenant)
    return out


def test_equal_weights_alternate_whatever_the_arrival_order():
    q = FairQueue()
    for _ in range(4):
        q.append(req("a"))
    for _ in range(4):
        q.append(req("b"))
    # fcfs would admit a a a a b b b b
    assert drain(q) == ["a", "b", "a", "b", "a", "b", "a", "b"]


def test_weights_set_the_share_of_admissions():
    q = FairQueue({"a": 2.0, "b": 1.0})
    for _ in range(4):
        q.append(req("a"))
        q.append(req("b"))
    # virtual times (work 8 per request): a 0->4->8->12->16, b 0->8->16; ties go to the tenant queued longest
    assert drain(q) == ["a", "b", "a", "b", "a", "a", "b", "b"]


def test_long_run_shares_follow_three_weights():
    q = FairQueue({"x": 3.0, "y": 2.0, "z": 1.0})
    for t in "xyz":
        for _ in range(60):
            q.append(req(t))
    first = drain(q, 60)
    counts = {t: first.count(t) for t in "xyz"}
    assert abs(counts["x"] - 30) <= 1 and abs(counts["y"] - 20) <= 1 and abs(counts["z"] - 10) <= 1, counts


def test_the_charge_is_the_work_a_request_asks_for():
    q = FairQueue()
    for _ in range(2):
        q.append(req("big", prompt_len=40, max_tokens=40))  # 80 tokens of work each
    for _ in range(6):
        q.append(req("small", prompt_len=4, max_tokens=4))  # 8 each
    # big's first request costs as much as ten of small's: small's six all go before big's second
    assert drain(q) == ["big"] + ["small"] * 6 + ["big"]


def test_an_idle_tenant_reenters_at_the_current_virtual_time():
    q = FairQueue()
    for _ in range(10):
        q.append(req("a"))
    assert drain(q, 5) == ["a"] * 5  # a alone: its virtual time runs ahead
    for _ in range(3):
        q.append(req("b"))
    # b enters at the virtual time of a's latest admission, not at 0: it banked nothing while idle
    assert q.vtime("b") == pytest.approx(q.vtime("a") - 8)
    # so it starts at once, then alternates with a instead of taking five in a row
    assert drain(q, 6) == ["b", "a", "b", "a", "b", "a"]


def test_a_preempted_request_is_refunded_and_resumes_first():
    q = FairQueue()
    a1, a2, b1 = req("a"), req("a"), req("b")
    for r in (a1, a2, b1):
        q.append(r)
    assert q.popleft() is a1
    before = q.vtime("a")
    q.appendleft(a1)  # preempted: its charge comes back, and it is first of a's queue again
    assert q.vtime("a") == pytest.approx(before - 8)
    # a and b tie at virtual time 0 (b has waited longer); a1 still goes before a2
    assert [q.popleft() for _ in range(3)] == [b1, a1, a2]
    assert not q and len(q) == 0


def test_remove_membership_and_iteration():
    q = FairQueue()
    a1, b1, b2 = req("a"), req("b"), req("b")
    for r in (a1, b1, b2):
        q.append(r)
    assert len(q) == 3 and b2 in q and set(map(id, q)) == {id(a1), id(b1), id(b2)}
    q.remove(a1)  # an abort while waiting: a's queue is gone, b is next
    assert a1 not in q and q[0] is b1 and len(q) == 2
    with pytest.raises(ValueError):
        q.remove(a1)
    with pytest.raises(IndexError):
        q[1]  # noqa: B018  only the head is shown


def test_dead_heap_entries_do_not_pile_up():
    """Preemptions and aborts leave stale heap entries behind; the heap stays bounded by the live tenants."""
    q = FairQueue()
    keep = req("a")
    q.append(keep)
    for _ in range(500):
        r = req("b")
        q.append(r)
        q.remove(r)
        q.appendleft(q.popleft())  # a preemption of a's request: one more dead entry each time
    assert len(q._heap) <= 2 * len(q._queues) + 17
    assert q[0] is keep and len(q) == 1


# ---- in the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llms():
    """Two demo engines that differ only in the scheduler; one sequence per step, so requests queue."""
    base = ["+recipe=generate", "device.threads=1", "engine.max_num_seqs=1", "+tenants.a.weight=1",
            "+tenants.b.weight=1"]
    return {name: LLM(overrides=[*base, f"engine.scheduler={name}"]) for name in ("fair", "fcfs")}


def first_scheduled(plans: list[list[tuple[str, int]]]) -> list[str]:
    seen: list[str] = []
    for plan in plans:
        for rid, _ in plan:
            if rid not in seen:
                seen.append(rid)
    return seen


@pytest.mark.parametrize("name", ["fair", "fcfs"])
def test_a_flood_from_one_tenant_does_not_hold_another_back(llms, monkeypatch, name):
    llm = llms[name]
    assert isinstance(llm.engine.rt.scheduler, FairScheduler) == (name == "fair")
    plans = record_schedules(monkeypatch, llm)
    eng = llm.engine
    for i in range(5):
        eng.add_request("12+345=", greedy(3), tenant="a", request_id=f"a{i}")
    eng.add_request("12+345=", greedy(3), tenant="b", request_id="b0")
    while eng.has_unfinished():
        eng.step()
    order = first_scheduled(plans)
    if name == "fair":
        assert order == ["a0", "b0", "a1", "a2", "a3", "a4"]  # b starts at the first free slot
    else:
        assert order == ["a0", "a1", "a2", "a3", "a4", "b0"]  # behind a's whole queue
    assert_pool_empty(llm)


def test_fair_engine_aborts_waiting_requests_and_keeps_the_others_exact(llms):
    llm = llms["fair"]
    eng = llm.engine
    (alone,) = llm.generate("rev:abc=", greedy(6))
    for i in range(3):
        eng.add_request("copy:xyz=", greedy(4), tenant="a", request_id=f"x{i}")
    eng.add_request("rev:abc=", greedy(6), tenant="b", request_id="keep")
    eng.step()
    assert eng.abort("x1") is not None and eng.abort("x2") is not None  # both still waiting
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["keep"].token_ids == alone.token_ids and outs["x0"].finished
    assert "x1" not in outs and "x2" not in outs
    assert_pool_empty(llm)


def test_fault_suite_under_the_fair_scheduler_with_tenant_quotas(monkeypatch):
    """The randomized fault suite (aborts, preemptions by swap and recompute, sessions, failing stages, invalid
    submissions from several tenants) with every engine on ``fair`` and quotas (too large to refuse anything) on
    two of its tenants: nothing leaks or hangs, every request ends once with exactly its tokens alone, and every
    quota hold is settled exactly once (nothing left in flight)."""
    from litellm_pipeline.tasks import faults as fault_suite

    drawn = fault_suite.random_engine_config
    quotas = {f"tenants.{t}.{k}": v for t in ("t2", "faulty-2")
              for k, v in (("weight", 3), ("max_concurrent", 10**6), ("tokens_per_minute", 1e12))}
    monkeypatch.setattr(fault_suite, "random_engine_config",
                        lambda rng, need: {**drawn(rng, need), "engine.scheduler": "fair", **quotas})
    left: list[dict] = []
    run = fault_suite.FaultRun.run

    def run_and_check(self, num_ops, max_steps):
        run(self, num_ops, max_steps)
        ledger = self.engine.rt.tenants
        left.append({t: ledger.in_flight(t) for t in ("t2", "faulty-2")})

    monkeypatch.setattr(fault_suite.FaultRun, "run", run_and_check)
    r = fault_suite.run_fault_suite(fault_suite.FaultSettings(seed=1, runs=4, ops=60, progress=False))
    assert r["failures"] == []
    assert r["admitted"] > 50 and r["aborted"] > 5 and r["preemptions"] > 0, r
    assert left == [{"t2": 0, "faulty-2": 0}] * 4
