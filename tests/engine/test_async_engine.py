"""AsyncEngine: streams equal offline generation, batch concurrently, abort on cancel, survive engine errors.

Offline references are computed before the AsyncEngine starts (or after it stops): two threads stepping one
engine would take each other's outputs.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from _engine_util import assert_pool_empty, greedy
from hf_models import random_prompts

from litellm_pipeline.engine.async_engine import AsyncEngine, EngineStepError, _put_all
from litellm_pipeline.errors import OverloadedError


def run(coro, timeout: float = 60.0):
    """asyncio.run with a deadline: a broken engine loop fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(aeng: AsyncEngine, prompt, params, **kw) -> list:
    return [out async for out in aeng.generate(prompt, params, **kw)]


def joined(deltas) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.delta_token_ids], "".join(d.delta_text for d in deltas)


async def until_pool_empty(llm, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not llm.engine.rt.pool.is_empty() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert_pool_empty(llm)


def test_stream_matches_offline(llama):
    prompt, sp = random_prompts([17], seed=201)[0], greedy(12)
    (ref,) = llama.generate(prompt, sp)

    async def main():
        async with AsyncEngine(llama.engine) as aeng:
            return await collect(aeng, prompt, sp, request_id="one")

    deltas = run(main())
    assert joined(deltas) == (ref.token_ids, ref.text)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].request_id == "one"
    assert_pool_empty(llama)


def test_concurrent_streams_interleave_and_match_offline(llama):
    prompts, sp = random_prompts([9, 23, 14, 31], seed=202), greedy(10)
    refs = llama.generate(prompts, sp)
    order: list[tuple[int, bool]] = []  # (stream, finished) in the order the consumers saw them

    async def consume(aeng, i):
        deltas = []
        async for d in aeng.generate(prompts[i], sp):
            order.append((i, d.finished))
            deltas.append(d)
        return deltas

    async def main():
        async with AsyncEngine(llama.engine) as aeng:
            eng = llama.engine
            # no step runs until all four are queued: on a loaded machine the event loop may otherwise be
            # descheduled between two submissions while the engine's thread finishes the first request
            eng._lock.acquire()
            try:
                tasks = [asyncio.ensure_future(consume(aeng, i)) for i in range(4)]
                while len(eng.requests) < 4:
                    await asyncio.sleep(0)
            finally:
                eng._lock.release()
            return await asyncio.gather(*tasks)

    results = run(main())
    for deltas, ref in zip(results, refs):
        assert joined(deltas) == (ref.token_ids, ref.text)
    first_finish = next(k for k, (_, fin) in enumerate(order) if fin)
    assert {i for i, _ in order[:first_finish]} == {0, 1, 2, 3}, "streams ran one after another, not batched"
    assert_pool_empty(llama)


def test_cancelled_consumer_aborts_request(llama):
    victim_p, other_p = random_prompts([20, 12], seed=203)
    (ref,) = llama.generate(other_p, greedy(30))

    async def main():
        async with AsyncEngine(llama.engine) as aeng:
            got = asyncio.Event()

            async def victim():
                async for _ in aeng.generate(victim_p, greedy(200), request_id="victim"):
                    got.set()

            task = asyncio.create_task(victim())
            other = asyncio.create_task(collect(aeng, other_p, greedy(30)))
            await got.wait()
            assert "victim" in llama.engine.requests
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert "victim" not in llama.engine.requests, "cancelling the consumer did not abort the request"
            deltas = await other
            await until_pool_empty(llama)
            return deltas

    assert joined(run(main())) == (ref.token_ids, ref.text)


def test_abort_ends_stream(llama):
    prompt = random_prompts([10], seed=206)[0]

    async def main():
        async with AsyncEngine(llama.engine) as aeng:
            llama.engine.add_request(prompt, greedy(2))  # not ours: its outputs are dropped, loop unharmed
            deltas = []
            async for d in aeng.generate(prompt, greedy(200), request_id="x"):
                deltas.append(d)
                if len(deltas) == 2:
                    await aeng.abort("x")
            await aeng.abort("no-such-request")  # ignored
            assert aeng.running
            return deltas

    deltas = run(main())
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert all(not d.finished for d in deltas[:-1])
    assert_pool_empty(llama)


def test_bad_request_raises_and_others_continue(llama):
    good_p, sp = random_prompts([15], seed=204)[0], greedy(16)
    (ref,) = llama.generate(good_p, sp)

    async def main():
        async with AsyncEngine(llama.engine) as aeng:
            good = asyncio.create_task(collect(aeng, good_p, sp, request_id="good"))
            await asyncio.sleep(0)  # let it submit
            with pytest.raises(ValueError, match="1000000"):
                await collect(aeng, [5, 10**6, 7], sp, request_id="bad")
            with pytest.raises(ValueError, match="already in use"):  # must not hijack the live stream
                await collect(aeng, good_p, sp, request_id="good")
            sched = llama.engine.rt.scheduler
            assert list(llama.engine.requests) == ["good"] and list(aeng._streams) == ["good"]
            assert [r.request_id for r in [*sched.waiting, *sched.running]] == ["good"]
            return await good

    assert joined(run(main())) == (ref.token_ids, ref.text)
    assert_pool_empty(llama)


def test_step_failure_fails_in_flight_and_loop_survives(llama, monkeypatch):
    prompts, sp = random_prompts([11, 19, 13], seed=205), greedy(40)
    (ref,) = llama.generate(prompts[2], greedy(8))
    real_step, armed = llama.engine.step, []

    def step():
        if armed and armed.pop():
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(llama.engine, "step", step)

    async def main():
        async with AsyncEngine(llama.engine) as aeng:
            seen = [asyncio.Event(), asyncio.Event()]

            async def consume(i):
                async for _ in aeng.generate(prompts[i], sp):
                    seen[i].set()

            tasks = [asyncio.create_task(consume(i)) for i in range(2)]
            await asyncio.gather(*(e.wait() for e in seen))
            armed.append(True)
            for t in tasks:
                with pytest.raises(EngineStepError, match=r"RuntimeError: injected fault \(error id \w{12}\)"):
                    await t
            assert not armed and aeng.running
            await until_pool_empty(llama)
            return await collect(aeng, prompts[2], greedy(8))

    assert joined(run(main())) == (ref.token_ids, ref.text)
    assert_pool_empty(llama)


def test_idle_loop_sleeps_and_shutdown_stops_thread(llama, monkeypatch):
    steps = []
    monkeypatch.setattr(llama.engine, "step", lambda: steps.append(1) or [])
    aeng = AsyncEngine(llama.engine)
    aeng.start()
    aeng.start()  # a second start keeps the one thread
    thread = aeng._thread
    time.sleep(0.1)
    assert thread.is_alive() and thread.name == "engine-loop"
    assert steps == [], "the idle loop stepped an engine with nothing to do"
    aeng.shutdown()
    assert not thread.is_alive() and not aeng.running
    aeng.shutdown()  # a second call is harmless

    async def after():
        return await collect(aeng, [5, 6, 7], greedy(2))

    with pytest.raises(OverloadedError, match="not running") as info:
        run(after())
    assert info.value.status_code == 503
    assert_pool_empty(llama)


def test_a_steps_deltas_reach_their_loop_in_one_wake_up(llama):
    """Eight streams on one event loop: each step's deltas arrive through one call_soon_threadsafe, not eight,
    in order and equal to what the streams would get one call at a time."""
    prompts = random_prompts([5, 9, 12, 7, 15, 6, 10, 8], seed=5)
    params = greedy(6)

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            if cb is _put_all:  # the engine loop's deliveries (other threads may wake the loop too)
                calls.append(len(args[0]))
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        async with AsyncEngine(llama.engine) as aeng:
            results = await asyncio.gather(*(collect(aeng, p, params) for p in prompts))
        return calls, results

    calls, results = run(main())
    assert all(len(joined(r)[0]) == 6 for r in results)
    assert sum(calls) == sum(len(r) for r in results)  # every delta delivered once
    assert max(calls) > 1 and len(calls) < sum(calls)  # batched: fewer wake-ups than deltas
    assert_pool_empty(llama)
