"""check_telemetry_sink: a ``telemetry`` sink receives every kind of event, alone and inside a running engine.

The contract (``litellm_pipeline/telemetry/bus.py``): a class built as ``cls(**params)`` (from
``telemetry.params.<name>``) whose ``publish(event)`` takes any :class:`~litellm_pipeline.telemetry.events.Event`
(match on ``event.kind`` or the type, and ignore kinds you do not know: new ones get added). It runs inside the
engine step under the engine lock, so it must not raise and must be quick.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from litellm_pipeline.telemetry import MemorySink, events
from litellm_pipeline.testing._support import (
    assert_drained,
    build_llm,
    describe,
    resolve,
    run_to_completion,
)


def _value(tp: Any) -> Any:
    """A plausible value of an annotated field type (str, int, float, bool, optionals and tuples of them)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:  # tuple[X, ...]: one X; tuple[X, Y]: one of each
        if not args:
            return ()
        return (_value(args[0]),) if args[-1] is Ellipsis else tuple(_value(a) for a in args)
    if args:  # a union: its first non-None member
        return _value(next(a for a in args if a is not type(None)))
    return {str: "r0", int: 1, float: 0.5, bool: True}.get(tp, None)


def synthetic_events() -> list[events.Event]:
    """One event of every published type, with plausible field values."""
    out = []
    for name in events.__all__:
        cls = getattr(events, name)
        if cls is events.Event:
            continue
        hints = typing.get_type_hints(cls)
        kwargs = {f.name: _value(hints[f.name]) for f in dataclasses.fields(cls)}
        out.append(cls(**kwargs))
    return out


def _engine_events() -> list[events.Event]:
    """The events of a real run that produces every kind the engine has: rejections, tier choices and costs,
    preemption, evictions into a warm tier and promotions back, aborts, finishes and steps."""
    from litellm_pipeline.errors import InvalidRequestError
    from litellm_pipeline.sampling import SamplingParams

    llm = build_llm(["telemetry=memory", "cache.block_size=4", "cache.num_blocks=12", "cache.warm_blocks=16",
                     "engine.max_num_seqs=3", "pipeline.stages.select_tier.params.mode=balanced"])
    engine = llm.engine
    try:
        engine.add_request([999], SamplingParams(max_tokens=4))
    except InvalidRequestError:
        pass
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["copy:abcdefgh=", "copy:abcdefgz=", "rev:abcdefgh=", "12+345=", "copy:abcdefgh="]
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.abort(reqs[-1].request_id)
    run_to_completion(engine, reqs, 2000, "the telemetry workload")
    again = [engine.add_request(p, params) for p in prompts[:2]]  # prefix hits, some on demoted blocks
    run_to_completion(engine, again, 2000, "the telemetry workload")
    return list(engine.bus.sink(MemorySink).events)


def check_telemetry_sink(impl: str | type, params: dict[str, Any] | None = None) -> dict[str, int]:
    """Check a ``telemetry`` sink class (a registry name or the class), built with ``params``.

    It gets one synthetic event of every type in ``litellm_pipeline.telemetry.events``, then every event of a real
    demo-model run (rejection, tier choice, costs, preemption, eviction, demotion, promotion, abort, finish, step),
    then it is subscribed to a live engine for the same workload. No ``publish`` may raise, and the live engine must
    finish every request and end with an empty pool. Returns how many events of each kind it was given.
    """
    cls = resolve("telemetry", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    sink = cls(**(params or {}))
    seen: dict[str, int] = {}
    recorded = _engine_events()
    for e in [*synthetic_events(), *recorded]:
        try:
            sink.publish(e)
        except Exception as exc:
            raise AssertionError(f"telemetry sink {name}: publish({e!r}) raised {type(exc).__name__}: {exc}") from exc
        seen[e.kind] = seen.get(e.kind, 0) + 1
    from litellm_pipeline.sampling import SamplingParams

    llm = build_llm(["cache.block_size=4", "cache.num_blocks=12", "engine.max_num_seqs=3"])
    llm.engine.bus.subscribe(sink)
    outs = llm.generate(["copy:abcdefgh=", "12+345=", "rev:abcdefgh=", "copy:abcdefgh="],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    bad = [(o.request_id, o.error) for o in outs if o.error is not None]
    assert not bad, f"telemetry sink {name}: requests failed while it listened: {bad}"
    assert_drained(llm, f"telemetry sink {name}")
    return seen
