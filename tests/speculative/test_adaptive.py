"""Adaptive drafting: the k each request drafts is the one that pays most under the step costs measured here and
the request's acceptance; a draft that costs more than it yields is given up (never a loss), one that pays is kept."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from _engine_util import greedy
from hf_models import random_prompts

from litellm_pipeline import LLM
from litellm_pipeline import registry
from litellm_pipeline.registry import register
from litellm_pipeline.speculative.speculator import (
    SpecState, SpeculativeSettings, Speculator, StepCosts, expected_tokens, _EXPLORE_EVERY,
)


def test_expected_tokens():
    assert expected_tokens(0, 0.7) == 1
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(4, 1.0) == 5
    assert expected_tokens(4, 0.0) == 1


def test_step_costs_interpolate_and_extrapolate():
    c = StepCosts()
    assert c.estimate(1, 1) is None  # nothing measured for one request
    c.observe(1, 1, 1.0)
    assert c.estimate(1, 5) == 1.0  # one row count seen: as cheap as it (tried once, then known)
    c.observe(1, 5, 3.0)
    assert c.estimate(1, 3) == pytest.approx(2.0)  # between the two seen
    assert c.estimate(1, 7) == pytest.approx(4.0)  # along the last two seen
    c.observe(1, 5, 4.0)  # a moving average, not the last value
    assert 3.0 < c.estimate(1, 5) < 4.0
    assert c.estimate(2, 2) is None  # per number of requests


def _spec(k=4):
    return Speculator(proposer=SimpleNamespace(propose=None), settings=SpeculativeSettings("x", k), max_model_len=99)


def _req(kept, missed, k=4):
    return SimpleNamespace(spec_state=SpecState(k, kept, missed), output_ids=[])


def test_worth_picks_the_k_that_pays_most():
    s = _spec()
    s.costs.observe(1, 1, 1.0)
    s.costs.observe(1, 5, 2.0)  # each drafted row costs a quarter of a step
    good, bad = _req(9, 1), _req(2, 8)  # acceptance 0.9 and 0.2
    assert s._worth(1, [good], [4])[1] == [4]  # 4.1 tokens for 2 steps' time beats 3 tokens for 1.75
    assert s._worth(1, [good], [2])[1] == [2]  # capped by what it may draft
    assert s._worth(1, [bad], [4]) == ([], [])  # 1.2 tokens for 1.25 steps' time: a loss
    s.costs.observe(1, 2, 1.02)  # nearly free rows: even 0.2 pays for one
    assert s._worth(1, [bad], [4])[1] == [1]
    assert s._worth(2, [good], [4]) == ([], [])  # nothing measured for two requests: this step measures it


def test_worth_shares_the_step_between_requests():
    s = _spec()
    s.costs.observe(2, 2, 1.0)
    s.costs.observe(2, 6, 1.2)
    good, bad = _req(9, 1), _req(0.1, 9.9)
    reqs, ks = s._worth(2, [good, bad], [4, 4])
    assert reqs == [good] and ks == [4]


def test_exploration_tries_each_other_k_within_its_budget():
    s = _spec()
    s.costs.observe(1, 1, 1.0)
    s.costs.observe(1, 5, 3.0)  # drafted rows cost half a step each: for 0.01 acceptance, never worth it
    bad = _req(0.1, 9.9)
    picks = [s._worth(1, [bad], [4])[1] for _ in range(10 * _EXPLORE_EVERY)]
    assert picks == [[]] * len(picks)  # nothing to spend: no tries
    s._explore_budget = 0.5 + 1.0 + 1.5 + 2.0  # what one try of each k costs beyond none
    picks = [s._worth(1, [bad], [4])[1] for _ in range(10 * _EXPLORE_EVERY)]
    tries = [p for p in picks if p]
    assert sorted(tries) == [[1], [2], [3], [4]]  # each other k once, then the budget is spent
    at = [i for i, p in enumerate(picks) if p]
    assert all(b - a >= _EXPLORE_EVERY for a, b in zip(at, at[1:]))  # at most one decision in _EXPLORE_EVERY
    assert s._explore_budget == pytest.approx(0.0)
    for _ in range(100):  # steps measured give it 1% of their time
        s.observe(1, 1.0)
    assert s._explore_budget == pytest.approx(1.0)


def test_a_first_step_that_paid_for_warming_up_does_not_end_drafting():
    s = _spec()
    good = _req(9, 1)
    for _ in range(2):  # plain steps of one request: the first held back, the second known
        s._measure = 1
        s.observe(1, 1.0)
    assert s.costs.estimate(1, 1) == 1.0
    assert s._worth(1, [good], [4])[1] == [4]  # drafted rows estimated as cheap as the step: tried
    s._measure, s._drafted = 1, 4
    s.observe(1, 9.0)  # its first verification paid for warming up: held back, so it is tried again
    assert s.costs.estimate(1, 5) == 1.0 and s._worth(1, [good], [4])[1] == [4]
    s._measure, s._drafted = 1, 4
    s.observe(1, 1.5)  # the cheaper of its first two times starts its average
    assert s.costs.estimate(1, 5) == 1.5 and s._worth(1, [good], [4])[1] == [4]
    s._measure, s._drafted = 1, 4
    s.observe(1, 9.0)  # from now on each time moves the average (a slower one a little)
    assert 1.5 < s.costs.estimate(1, 5) < 2.5


def _oracle(ref_ids, delay_s):
    class Oracle:
        """Drafts exactly what the model will generate (so every token is kept), taking ``delay_s`` per call."""

        def __init__(self, rt):
            pass

        def propose(self, reqs, ks):
            time.sleep(delay_s)
            return [ref_ids[len(r.output_ids):len(r.output_ids) + k] for r, k in zip(reqs, ks)]

    return Oracle


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return hf_checkpoint("llama")


def test_a_draft_that_costs_more_than_it_yields_is_given_up(path, steady_steps):
    prompt = random_prompts([9], seed=5)[0]
    sp = greedy(64)
    ref = LLM(model=str(path), dtype="float32").generate(prompt, sp)[0].token_ids
    outs = {}
    for name, delay in (("slow", 0.05), ("free", 0.0)):
        with registry.isolated():
            register("proposer", name)(_oracle(ref, delay))
            llm = LLM(model=str(path), dtype="float32", overrides=[f"speculative.method={name}"])
            outs[name] = llm.generate(prompt, sp)[0]
        assert outs[name].token_ids == ref
    # 50 ms per draft against a step of about a millisecond: drafted twice (a shape's first time is held back as a
    # possible warm-up), and not again: a try of another k would cost 50 times what 1% of the steps gives it
    assert outs["slow"].num_draft_tokens == 8
    # the same drafts for free: every token is kept, so it drafts nearly every step
    assert outs["free"].num_accepted_tokens >= 40


class _Lookup:
    """A free proposer that drafts ``script[len(output):]`` (what the request will generate), counting its calls."""

    free = True

    def __init__(self, script):
        self.script, self.calls = script, 0

    def propose(self, reqs, ks):
        self.calls += 1
        return [self.script[len(r.output_ids):len(r.output_ids) + k] for r, k in zip(reqs, ks)]


def _running(out):
    return SimpleNamespace(num_computed=10 + len(out), num_tokens=11 + len(out), matcher=None, spec_state=None,
                           spec_tokens=None, output_ids=out, params=SimpleNamespace(max_tokens=99), draft=[])


def test_a_free_proposer_learns_from_requests_that_do_not_draft():
    script = list(range(100, 140))
    prop = _Lookup(script)
    s = Speculator(prop, SpeculativeSettings("x", 4), max_model_len=999)
    s.costs.observe(1, 1, 1.0)
    s.costs.observe(1, 5, 2.0)
    s.kept, s.missed = 0.01, 9.99  # the engine's recent drafts all failed: a new request starts expecting none
    req = _running([script[0]])
    s.propose([req])
    assert req.draft == [] and req.spec_state.shadow == script[1:5]  # not worth a row, but looked up for free
    assert prop.calls == 1
    for t in script[1:3]:  # two of the shadow's tokens come true: it would have kept them, so it decides now
        req.output_ids.append(t)
        req.num_computed += 1
        req.num_tokens += 1
        s.propose([req])
    assert req.draft and req.draft == script[3:3 + len(req.draft)]
    assert req.spec_state.shadow is None  # drafting now: its verification tells the rest


def test_a_shadow_that_misses_at_once_counts_a_miss_and_ends_the_lookups():
    prop = _Lookup([7] * 50)  # always drafts 7s; the request never makes one
    s = Speculator(prop, SpeculativeSettings("x", 4), max_model_len=999)
    s.costs.observe(1, 1, 1.0)
    s.costs.observe(1, 5, 3.0)
    req = _running([1])
    calls = []
    for i in range(40):
        s.propose([req])
        calls.append(prop.calls)
        req.output_ids.append(1)
        req.num_computed += 1
        req.num_tokens += 1
    st = req.spec_state
    assert st.kept / (st.kept + st.missed) < 0.5  # the shadow's miss counted against the neutral start
    assert prop.calls == 1  # wrong from its first token: it stops looking up (and waits 1, 2, 4 ... tokens)
    assert st.resume_at - len(req.output_ids) >= 8


def test_a_proposer_that_is_not_free_is_asked_only_to_draft():
    prop = _Lookup(list(range(100, 140)))
    prop.free = False
    s = Speculator(prop, SpeculativeSettings("x", 4), max_model_len=999)
    s.costs.observe(1, 1, 1.0)
    s.costs.observe(1, 5, 2.0)
    s.kept, s.missed = 0.01, 9.99
    req = _running([100])
    s.propose([req])
    assert req.draft == [] and prop.calls == 0 and req.spec_state.shadow is None


def test_a_draft_filled_to_nothing_counts_a_miss():
    def fill(reqs):
        for r in reqs:
            r.draft = []  # the draft model's first token ends the request

    s = Speculator(SimpleNamespace(propose=None, fill=fill), SpeculativeSettings("x", 4), max_model_len=99)
    req = _req(5.0, 0.0)
    req.draft = [3, 3]
    before = s.missed
    assert s.fill([(req, 3)])
    assert req.spec_state.missed == 1.0 and s.missed == pytest.approx(before * 0.9 + 1.0)
