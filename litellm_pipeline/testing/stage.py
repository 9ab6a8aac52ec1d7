"""check_stage: a ``stage`` class inside real engine runs of the embedded demo model.

The contract (``litellm_pipeline/stages/base.py``): a class with ``level`` ("request" or "step"), ``inputs`` and
``outputs`` (context field names), built once as ``cls(rt, **params)`` and called as ``stage(ctx)``. Step stages
transform the step context and leave request bookkeeping to the engine's postprocess, so whatever a stage does, the
engine must still: finish every request (with "stop", "length" or "budget", never "error"), keep the token limits,
stream deltas that add up to the final text, survive aborts and preemption, and end with every KV block back.
The check places the stage in the default graph (at the first position where its inputs exist, or where told) and
runs exactly those things.
"""

from __future__ import annotations

from typing import Any, Sequence

from litellm_pipeline.telemetry import MemorySink
from litellm_pipeline.testing._support import DEMO_PROMPTS, assert_drained, build_llm, config_name, describe, resolve

MAX_STEPS = 2000
CHECKED = "checked"  # the name the stage gets in the graph


def _default_order(overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    from litellm_pipeline.config.compose import compose

    cfg = compose(list(overrides))
    return list(cfg.pipeline.order), {n: cfg.pipeline.stages[n].impl for n in cfg.pipeline.order}


def place(cls: type, order: list[str], impls: dict[str, str], after: str | None, before: str | None) -> list[str]:
    """The graph order with the stage inserted: after/before a named stage, else at the first position the
    builder's graph check accepts (right after the stages that produce its inputs)."""
    from litellm_pipeline import registry
    from litellm_pipeline.config.build import check_graph
    from litellm_pipeline.errors import ConfigError

    if after is not None or before is not None:
        anchor = after if after is not None else before
        assert anchor in order, f"stage {anchor!r} is not in the pipeline {order}"
        i = order.index(anchor) + (after is not None)
        return [*order[:i], CHECKED, *order[i:]]
    classes = [(n, registry.get("stage", impls[n])) for n in order]
    errors = []
    for i in range(len(order) + 1):
        try:
            check_graph([*classes[:i], (CHECKED, cls), *classes[i:]])
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        return [*order[:i], CHECKED, *order[i:]]
    raise AssertionError(f"stage {describe(cls)} fits nowhere in {order}: {errors[-1]}")


def _params_mix(max_tokens: int) -> list:
    """Greedy, seeded sampling, stop strings, logprobs and EOS: a step holds all of them at once."""
    from litellm_pipeline.sampling import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["1", "e"]),
        SamplingParams(temperature=1.0, seed=7, top_k=5, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, top_p=0.9, max_tokens=max_tokens),
    ]


def _run(llm, prompts: Sequence[str], params: list, what: str, abort_after: int | None = None) -> list:
    """Submit every prompt, step to the end (aborting the first request after ``abort_after`` steps), check
    every request's end; returns ``(token_ids, text, finish_reason)`` per prompt (None: aborted)."""
    engine = llm.engine
    reqs = [engine.add_request(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    deltas = {r.request_id: [] for r in reqs}
    final = {}
    aborted = None
    for step in range(MAX_STEPS):
        if all(r.finished for r in reqs):
            break
        if abort_after is not None and step == abort_after and not reqs[0].finished:
            aborted = reqs[0].request_id
            engine.abort(aborted)
        for out in engine.step():
            if out.request_id in deltas:
                deltas[out.request_id].append(out.delta_text)
                if out.finished:
                    final[out.request_id] = out
    left = [r.request_id for r in reqs if not r.finished]
    assert not left, f"{what}: requests {left} did not finish within {MAX_STEPS} engine steps"
    for r, p in zip(reqs, [params[i % len(params)] for i in range(len(reqs))]):
        if r.request_id == aborted:
            continue
        out = final.get(r.request_id)
        assert out is not None, f"{what}: request {r.request_id} ({r.prompt_ids}) finished without a final output"
        assert out.finish_reason in ("stop", "length", "budget") and out.error is None, (
            f"{what}: request {r.request_id} finished with {out.finish_reason!r}: {out.error}"
        )
        assert 1 <= len(out.token_ids) <= p.max_tokens, (
            f"{what}: request {r.request_id} produced {len(out.token_ids)} tokens (max_tokens {p.max_tokens})"
        )
        streamed = "".join(deltas[r.request_id])
        assert streamed == out.text, (
            f"{what}: request {r.request_id} streamed {streamed!r} but its final text is {out.text!r} (the deltas "
            "must add up to the text)"
        )
    assert_drained(llm, what)
    return [(o.token_ids, o.text, o.finish_reason) if (o := final.get(r.request_id)) else None for r in reqs]


def check_stage(
    impl: str | type,
    params: dict[str, Any] | None = None,
    *,
    after: str | None = None,
    before: str | None = None,
    replace: str | None = None,
    prompts: Sequence[str] = DEMO_PROMPTS,
    max_tokens: int = 12,
    overrides: Sequence[str] = (),
    deterministic: bool = True,
) -> dict[str, Any]:
    """Check a ``stage`` class (a registry name or the class) with ``params`` inside the demo model's pipeline.

    The stage replaces the stage named ``replace``, or is inserted as ``checked`` after/before a named stage, or
    by default at the first position whose upstream stages produce its inputs. Runs a mixed batch (greedy, seeded
    sampling, stop strings, logprobs) twice, again with one request aborted midway, and on a 10-block pool of
    4-token blocks that forces preemption; ``overrides`` are added to every engine's config. After each run every
    request has finished without error within its token limit, its streamed deltas add up to its text, and the
    pool is empty. With ``deterministic=True`` the repeated and the preempted runs must give the same outputs.
    Returns the pipeline order used and how many preemptions the tight run saw (``{"order", "preemptions"}``).
    """
    cls = resolve("stage", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    base_order, impls = _default_order(overrides)
    with config_name("stage", impl) as cfg_name:
        spec = {"impl": cfg_name, "params": dict(params or {})}
        if replace is not None:
            assert replace in base_order, f"stage {replace!r} is not in the pipeline {base_order}"
            order, graph = base_order, {f"pipeline.stages.{replace}": spec}
        else:
            order = place(cls, base_order, impls, after, before)
            graph = {f"pipeline.stages.{CHECKED}": spec, "pipeline.order": order}
        mix = _params_mix(max_tokens)
        llm = build_llm(overrides, **graph)
        built = [type(s) for s in (*llm.engine.request_stages, *llm.engine.step_stages)]
        assert cls in built, f"stage {name}: the engine built {built} from order {order}, without it"
        what = f"stage {name} in {order}"
        first = _run(llm, prompts, mix, what)
        again = _run(llm, prompts, mix, f"{what} (second run)")
        if deterministic:
            assert first == again, (
                f"{what}: the same requests gave different outputs the second time:\n{first}\n"
                f"{again}"
            )
        _run(llm, prompts, mix, f"{what} (first request aborted)", abort_after=3)
        tight = build_llm([*overrides, "cache.block_size=4", "cache.num_blocks=10"], **graph)
        sink = MemorySink()
        tight.engine.bus.subscribe(sink)
        squeezed = _run(tight, prompts, mix, f"{what} (10 blocks of 4 tokens: preemption)")
        if deterministic:
            assert squeezed == first, (
                f"{what}: under preemption the outputs changed:\n{first}\n{squeezed}"
            )
    return {"order": order, "preemptions": sink.counts["preempted"]}
