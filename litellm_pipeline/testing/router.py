"""check_router: a ``router`` class against the limits each request's TierSet sets, on scripted and real steps.

The contract (:class:`litellm_pipeline.registry.interfaces.Router`): built as ``cls(model_cfg, device, **params)``, called once
per step as ``plan(schedule)`` with ``[(request, num_new_tokens)]`` in row order; returns None (the checkpoint's own
routing for every token), one ``RoutePlan`` for every layer, or a tuple with one entry per decoder layer. What must
hold, token by token: never more experts than its request's TierSet allows in that layer, never an expert outside
the TierSet's ``allowed_experts``, at least one expert; the same schedule gives the same plan, and a token's limits
depend only on its own request (not on the batch it shares, nor its row). Checked on random schedules of the demo
model (MoE, 4 layers, 8 experts, top-2) over tiers with uniform, per-layer and restricted-expert counts, then inside
the engine, where every plan the router makes is checked against its step and every request must finish.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from litellm_pipeline.testing._support import DEMO_PROMPTS, assert_drained, build_llm, config_name, describe, resolve

# tiers of every shape a router meets: uniform counts below, at and above the checkpoint's top-2, per-layer
# lists, and ones restricted to a subset of the experts
TIERS = {
    "k1": "{experts_per_token: 1, cost: 0.2}",
    "k3": "{experts_per_token: 3, cost: 0.6}",
    "layered": "{experts_per_token: [1, 2, 3, 1], cost: 0.4}",
    "narrow": "{experts_per_token: 2, allowed_experts: [0, 3, 5], cost: 0.3}",
    "narrow_layered": "{experts_per_token: [2, 1, 1, 3], allowed_experts: [1, 2, 6, 7], cost: 0.3}",
}
BUILT_IN = ("fast", "balanced", "deep", "max")


def _tier_overrides() -> list[str]:
    return [f"+tiers.{name}={spec}" for name, spec in TIERS.items()]


def _token_limits(plan: Any, schedule: Sequence, native_k: int, num_layers: int, num_experts: int,
                  device: torch.device, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise a plan into per-token ``k [T, L]`` and ``allowed [T, L, E]``, checking its form on the way."""
    t = sum(n for _, n in schedule)
    if plan is None or not isinstance(plan, tuple):
        plans = [plan] * num_layers
    else:
        assert len(plan) == num_layers, f"{what}: a per-layer plan needs {num_layers} entries, got {len(plan)}"
        plans = list(plan)
    ks = torch.full((t, num_layers), native_k, dtype=torch.long)
    allowed = torch.ones(t, num_layers, num_experts, dtype=torch.bool)
    for layer, p in enumerate(plans):
        if p is None:
            continue
        where = f"{what}, layer {layer}"
        for field in ("top_k", "max_k", "allowed"):
            assert hasattr(p, field), f"{where}: a plan must be a RoutePlan (no {field!r} on {type(p).__name__})"
        if p.max_k is not None:
            assert isinstance(p.max_k, int) and not isinstance(p.max_k, bool), (
                f"{where}: max_k must be a plain int (no host sync per layer), got {type(p.max_k).__name__}"
            )
        if p.top_k is not None:
            tk = p.top_k
            assert isinstance(tk, torch.Tensor) and tk.shape == (t,) and not tk.dtype.is_floating_point, (
                f"{where}: top_k must be an integer tensor [{t}], got {getattr(tk, 'dtype', type(tk))} "
                f"{tuple(getattr(tk, 'shape', ()))}"
            )
            assert tk.device.type == device.type, f"{where}: top_k is on {tk.device}, the model on {device}"
            assert p.max_k is not None and int(tk.max()) == p.max_k, (
                f"{where}: max_k ({p.max_k}) must be the largest entry of top_k ({int(tk.max())})"
            )
            ks[:, layer] = tk.cpu().long()
        elif p.max_k is not None:
            ks[:, layer] = p.max_k
        if p.allowed is not None:
            a = p.allowed
            assert isinstance(a, torch.Tensor) and a.dtype == torch.bool and a.shape == (t, num_experts), (
                f"{where}: allowed must be a bool tensor [{t}, {num_experts}], got {getattr(a, 'dtype', type(a))} "
                f"{tuple(getattr(a, 'shape', ()))}"
            )
            assert a.device.type == device.type, f"{where}: allowed is on {a.device}, the model on {device}"
            allowed[:, layer] = a.cpu()
    return ks, allowed


def _check_plan(plan: Any, schedule: Sequence, native_k: int, num_layers: int, num_experts: int,
                device: torch.device, what: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Check one plan against its schedule; returns each request's rows ``(k [n, L], allowed [n, L, E])``."""
    ks, allowed = _token_limits(plan, schedule, native_k, num_layers, num_experts, device, what)
    rows, start = {}, 0
    for req, n in schedule:
        ts = req.tierset
        k, a = ks[start : start + n], allowed[start : start + n]
        who = f"{what}: request {req.request_id} (tier {ts.name!r}, rows {start}..{start + n - 1})"
        for layer, limit in enumerate(ts.experts_per_layer):
            got = k[:, layer]
            assert int(got.min()) >= 1, f"{who}, layer {layer}: a token gets {int(got.min())} experts (at least 1)"
            assert int(got.max()) <= limit, (
                f"{who}, layer {layer}: a token gets {int(got.max())} experts, its TierSet allows {limit}"
            )
            usable = a[:, layer].sum(dim=1)
            assert int(usable.min()) >= 1, f"{who}, layer {layer}: a token has no allowed expert"
        if ts.allowed_experts is not None:
            outside = torch.ones(num_experts, dtype=torch.bool)
            outside[list(ts.allowed_experts)] = False
            leaked = a[:, :, outside].any(dim=(0, 1)).nonzero().flatten().tolist()
            assert not leaked, (
                f"{who}: experts {leaked} are allowed, outside its TierSet's allowed_experts {ts.allowed_experts}"
            )
        rows[req.request_id] = (k, a)
        start += n
    return rows


def check_router(impl: str | type, params: dict[str, Any] | None = None, *, schedules: int = 40,
                 engine: bool = True, seed: int = 0) -> dict[str, int]:
    """Check a ``router`` class (a registry name or the class) built with ``params`` on the demo model.

    ``schedules`` random steps (1-6 requests of mixed tiers, 1-9 tokens each, prefill chunks and decodes) check
    every plan's form and limits, determinism (the same schedule twice) and independence (each request's rows
    equal to the ones it gets alone); with ``engine=True`` the demo engine runs mixed-tier requests through the
    router (every plan it makes is checked against its step) and every request finishes with all KV blocks back.
    Returns how many plans were checked: ``{"scripted": ..., "engine": ...}``.
    """
    cls = resolve("router", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    params = dict(params or {})
    llm = build_llm(_tier_overrides())
    rt = llm.engine.rt
    mc = rt.model_cfg
    native_k, num_layers, num_experts = mc.experts_per_token, mc.num_layers, mc.num_experts
    try:
        router = cls(mc, rt.device, **params)
    except Exception as exc:
        raise AssertionError(f"router {name}: cls(model_cfg, device, **{params}) raised {exc!r}") from exc
    assert callable(getattr(router, "plan", None)), f"router {name}: the built object has no plan(schedule) method"

    from litellm_pipeline.sampling import SamplingParams

    tiers = [*BUILT_IN, *TIERS]
    reqs = [llm.engine.add_request(DEMO_PROMPTS[i % len(DEMO_PROMPTS)], SamplingParams(max_tokens=4), tier=tier)
            for i, tier in enumerate(tiers)]
    for r, tier in zip(reqs, tiers):
        assert r.tierset is not None and r.tierset.name == tier, f"request for tier {tier!r} got {r.tierset}"
    rng = random.Random(seed)
    what = f"router {name}"
    alone: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for i in range(schedules):
            picked = rng.sample(reqs, rng.randint(1, 6))
            schedule = [(r, rng.choice((1, 1, 1, rng.randint(2, 9)))) for r in picked]
            schedule.sort(key=lambda e: e[1] == 1)  # the engine's row order: prefill chunks, then decodes
            step = f"{what}, schedule {i} {[(r.tierset.name, n) for r, n in schedule]}"
            plan = router.plan(schedule)
            rows = _check_plan(plan, schedule, native_k, num_layers, num_experts, rt.device, step)
            again = _check_plan(router.plan(schedule), schedule, native_k, num_layers, num_experts, rt.device, step)
            for rid, (k, a) in rows.items():
                assert torch.equal(k, again[rid][0]) and torch.equal(a, again[rid][1]), (
                    f"{step}: the same schedule twice gives request {rid} different limits"
                )
            for r, n in schedule:  # the limits a request gets alone, with n tokens
                key = (r.request_id, n)
                if key not in alone:
                    solo = [(r, n)]
                    alone[key] = _check_plan(router.plan(solo), solo, native_k, num_layers, num_experts, rt.device,
                                             f"{what}, request {r.request_id} alone")[r.request_id]
                k, a = rows[r.request_id]
                assert torch.equal(k, alone[key][0]) and torch.equal(a, alone[key][1]), (
                    f"{step}: request {r.request_id} (tier {r.tierset.name!r}) gets other limits in this batch than "
                    f"alone (expert counts {k.tolist()} vs {alone[key][0].tolist()}): a token's limits must depend "
                    "only on its own request"
                )
    finally:
        for r in reqs:
            llm.engine.abort(r.request_id)
    assert_drained(llm, what)
    seen = {"scripted": schedules, "engine": 0}
    if engine:
        seen["engine"] = _check_in_engine(impl, params, name, native_k, num_layers, num_experts)
    return seen


def _check_in_engine(impl, params: dict, name: str, native_k: int, num_layers: int, num_experts: int) -> int:
    from litellm_pipeline.sampling import SamplingParams

    what = f"router {name} in the demo engine"
    with config_name("router", impl) as cfg:
        extra = [f"+pipeline.stages.route.params.{k}={v!r}" for k, v in params.items()]
        llm = build_llm([*_tier_overrides(), f"pipeline.stages.route.params.router={cfg}", *extra,
                         "engine.max_num_batched_tokens=24"])
    route = next(s for s in llm.engine.step_stages if hasattr(s, "router"))
    made = []
    inner = route.router.plan

    def plan(schedule):
        p = inner(schedule)
        made.append(len(schedule))
        _check_plan(p, schedule, native_k, num_layers, num_experts, llm.engine.rt.device,
                    f"{what}, step {len(made)} {[(r.tierset.name, n) for r, n in schedule]}")
        return p

    route.router.plan = plan
    tiers = [*BUILT_IN, *TIERS]
    params_mix = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.8, seed=2, max_tokens=10)]
    reqs = [llm.engine.add_request(p, params_mix[i % 2], tier=tiers[i % len(tiers)])
            for i, p in enumerate(DEMO_PROMPTS * 2)]
    for _ in range(500):
        if all(r.finished for r in reqs):
            break
        llm.engine.step()
    left = [r.request_id for r in reqs if not r.finished]
    assert not left, f"{what}: requests {left} did not finish within 500 steps"
    bad = [(r.request_id, r.finish_reason) for r in reqs if r.finish_reason not in ("stop", "length")]
    assert not bad, f"{what}: requests ended with {bad}"
    assert max(made) > 1, f"{what}: the router never saw a batch of several requests ({made})"
    assert_drained(llm, what)
    return len(made)
