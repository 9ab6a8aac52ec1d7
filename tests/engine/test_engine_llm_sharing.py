"""Several LLM.stream / LLM.generate callers sharing one LLM: each gets all of its own output.

``LLM.stream`` and ``LLM.generate`` step the shared engine themselves and keep only the outputs of their own
requests. Whatever a step produced for *another* caller's request must still reach that caller.
"""

from __future__ import annotations

import threading

from _engine_util import alone, assert_pool_empty, greedy
from hf_models import random_prompts


def test_interleaved_streams(llama):
    """Two streams consumed alternately (one thread): neither loses tokens, both end."""
    p1, p2 = random_prompts([10, 12], seed=101)
    sp1, sp2 = greedy(6), greedy(9)
    s1, s2 = llama.stream(p1, sp1), llama.stream(p2, sp2)
    got: dict[int, list] = {1: [], 2: []}
    live = {1: s1, 2: s2}
    while live:
        for k in list(live):
            try:
                got[k].append(next(live[k]))
            except StopIteration:
                del live[k]
    for k, p, sp in ((1, p1, sp1), (2, p2, sp2)):
        ref = alone(llama, p, sp)
        assert [t for d in got[k] for t in d.token_ids] == ref.token_ids, f"stream {k} lost tokens"
        assert "".join(d.text for d in got[k]) == ref.text
        assert got[k][-1].finish_reason == "length"
    assert_pool_empty(llama)


def test_generate_while_another_request_finishes(llama):
    """A request submitted through the engine finishes during a generate() call: generate must still wait
    for, and return, its own outputs (it used to count the other request's finish as one of its own)."""
    eng = llama.engine
    other_p, p = random_prompts([6, 9], seed=104)
    ref = alone(llama, p, greedy(10))
    other = eng.add_request(other_p, greedy(3))
    eng.step()
    (out,) = llama.generate(p, greedy(10))
    assert out.token_ids == ref.token_ids and out.finished
    assert other.finished and len(other.output_ids) == 3
    assert_pool_empty(llama)


def test_generate_from_two_threads(llama):
    """Two threads each calling generate() several times; every call returns its own outputs. (Each finish
    stepped by the wrong thread used to break a call, so the rounds make a pass by luck unlikely.)"""
    prompts = random_prompts([8, 21, 14, 30], seed=102)
    rounds = {0: [5, 9, 7, 11, 6], 1: [6, 8, 10, 12, 4]}  # max_tokens per round: finishes fall in different steps
    refs = {
        (k, n): [alone(llama, p, greedy(n)).token_ids for p in prompts[2 * k : 2 * k + 2]]
        for k, ns in rounds.items()
        for n in ns
    }
    results: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(k: int) -> None:
        try:
            start.wait(10)
            for n in rounds[k]:
                results[k, n] = [o.token_ids for o in llama.generate(prompts[2 * k : 2 * k + 2], greedy(n))]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, f"a generate() call failed: {errors[0]!r}"
    assert results == refs
    assert_pool_empty(llama)


def test_abort_of_a_streamed_request_ends_the_stream(llama):
    """Aborting a streamed request by id (e.g. a server's cancel endpoint) ends its stream."""
    prompt = random_prompts([10], seed=103)[0]
    deltas = []
    for d in llama.stream(prompt, greedy(30)):
        deltas.append(d)
        if len(deltas) == 2:
            (rid,) = list(llama.engine.requests)
            llama.engine.abort(rid)
    assert len(deltas) <= 3
    assert all(d.finish_reason in (None, "abort") for d in deltas)
    assert_pool_empty(llama)
