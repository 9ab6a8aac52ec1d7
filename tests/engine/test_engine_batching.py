"""Batching changes nothing: each request gets the tokens it gets alone (1-token prompts and threads too)."""

from __future__ import annotations

import threading
import time

import pytest
from _engine_util import alone, assert_pool_empty, greedy, record_schedules, run_engine
from hf_models import hf_generate, random_prompts

LENGTHS = [3, 17, 40, 64, 90, 120]
MAX_TOKENS = [8, 24, 12, 20, 16, 10]


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_batch_equals_alone(make_llm, arch):
    llm = make_llm(arch)
    prompts = random_prompts(LENGTHS, seed=11)
    params = [greedy(m) for m in MAX_TOKENS]
    batch = llm.generate(prompts, params)
    singles = [alone(llm, p, sp) for p, sp in zip(prompts, params)]
    for i, (b, s) in enumerate(zip(batch, singles)):
        assert b.token_ids == s.token_ids, f"prompt {i} (length {LENGTHS[i]}): batched output differs from alone"
        assert b.text == s.text
        assert len(b.token_ids) == MAX_TOKENS[i] and b.finish_reason == "length"
        assert b.prompt_token_ids == prompts[i]
    # the prompts really lead to different outputs (a model ignoring its input would pass the checks above)
    assert len({tuple(b.token_ids[:8]) for b in batch}) >= 4
    assert_pool_empty(llm)


def test_batch_in_mixed_steps_equals_alone(make_llm):
    """Requests arriving while others decode: steps hold prompt chunks and decodes together."""
    llm = make_llm("mixtral")
    eng = llm.engine
    prompts = random_prompts([9, 33, 1, 57, 20], seed=12)
    params = [greedy(n) for n in (14, 10, 9, 6, 12)]
    ids = []
    for p, sp in zip(prompts, params):  # a new arrival every step
        ids.append(eng.add_request(p, sp).request_id)
        eng.step()
    final, _ = run_engine(eng, ids)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert final[ids[i]].token_ids == alone(llm, p, sp).token_ids, f"request {i}"
    assert_pool_empty(llm)


def test_one_token_prompt(make_llm, hf_checkpoint, monkeypatch):
    """A 1-token prompt's first step is decode-shaped (one new token, nothing cached yet)."""
    llm = make_llm("llama")
    one = [random_prompts([1], seed=13)[0], [0]]  # a byte token, and <s> alone
    ref = hf_generate(hf_checkpoint("llama"), one, 10)
    plans = record_schedules(monkeypatch, llm)
    for p, (ref_ids, _) in zip(one, ref):
        out = alone(llm, p, greedy(10))
        assert out.token_ids == ref_ids, "1-token prompt differs from transformers"
    assert plans[0] == [(plans[0][0][0], 1)]  # the first step computed exactly one token
    # batched with a long prompt chunk and with decodes
    long = random_prompts([70], seed=14)[0]
    outs = llm.generate([long, one[0], one[1]], [greedy(10), greedy(10), greedy(10)])
    assert [o.token_ids for o in outs[1:]] == [r[0] for r in ref]
    assert outs[0].token_ids == alone(llm, long, greedy(10)).token_ids
    eng = llm.engine
    rid = eng.add_request(long, greedy(12)).request_id
    eng.step()
    rid1 = eng.add_request(one[0], greedy(10)).request_id  # joins a step of pure decodes
    final, _ = run_engine(eng, [rid, rid1])
    assert final[rid1].token_ids == ref[0][0]
    assert_pool_empty(llm)


def test_thread_adds_while_main_steps(make_llm):
    llm = make_llm("llama")
    eng = llm.engine
    prompts = random_prompts([5, 31, 12, 48, 2, 20, 64, 9], seed=15)
    params = [greedy(6 + i) for i in range(len(prompts))]
    added: list[str] = []
    errors: list[BaseException] = []

    def adder():
        try:
            for p, sp in zip(prompts, params):
                added.append(eng.add_request(p, sp).request_id)
                time.sleep(0.003)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=adder)
    final = {}
    t.start()
    deadline = time.monotonic() + 60
    while (t.is_alive() or eng.has_unfinished()) and time.monotonic() < deadline:
        if not eng.has_unfinished():
            time.sleep(0.0005)  # nothing in flight yet: wait for the adder rather than spin
            continue
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    t.join()
    assert not errors, errors
    assert set(final) == set(added) and len(added) == len(prompts)
    for rid, p, sp in zip(added, prompts, params):
        assert final[rid].token_ids == alone(llm, p, sp).token_ids
    assert_pool_empty(llm)


def test_thread_aborts_while_main_steps(make_llm):
    llm = make_llm("llama")
    eng = llm.engine
    prompts = random_prompts([11, 23, 35], seed=16)
    sp = greedy(40)
    victim_params = greedy(400)  # still generating whenever the other thread gets to run
    ids = [eng.add_request(p, victim_params if i == 1 else sp).request_id for i, p in enumerate(prompts)]
    eng.step()
    stepped = threading.Event()
    steps = [0]
    waited = []

    def aborter():
        stepped.wait(10)
        before = steps[0]
        eng.abort(ids[1])
        waited.append(steps[0] - before)

    t = threading.Thread(target=aborter)
    t.start()
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        steps[0] += 1
        stepped.set()
    t.join()
    assert ids[1] not in final
    # the lock is handed over at the next step: the abort waited for the step in progress, not for a free moment
    # between back-to-back steps (which an unfair lock may never give)
    assert waited and waited[0] <= 2, waited
    for i in (0, 2):
        assert final[ids[i]].token_ids == alone(llm, prompts[i], sp).token_ids
    assert_pool_empty(llm)
