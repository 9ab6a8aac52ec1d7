"""check_layer_ops: a ``layer_ops`` class against float64 math, op by op, and optionally inside the demo model.

The contract (``litellm_pipeline/model/layer_ops.py``): a class built with no arguments (and with
``deterministic=True`` in the batch-invariant mode, if it takes that keyword) whose instance the decode stage binds
to every layer. Required methods and what each must compute:

* ``linear(x [M, K], w [O, K], bias=None)`` = ``x @ w.T + bias``
* ``rms_norm(x, w, eps)`` = ``w * x / sqrt(mean(x^2, -1) + eps)``
* ``add_rms_norm(x, residual, w, eps)`` = ``(s, rms_norm(s))`` with ``s = x + residual``
* ``silu_mul(gate_up [..., 2I])`` = ``silu(gate) * up``
* ``rotary(q [T, Hq, D], k [T, Hk, D], cos [T, D], sin [T, D])`` = rotate-half RoPE of both (may work in place)
* ``residual_mlp(h, x, mlp)`` = ``h + mlp(x)`` for a ``GatedMLP``
* ``route(x, gate, native_k, normalize, plan)`` = ``(expert_idx, expert_w)``: each token's top experts by softmax
  probability within its TierSet (``plan``), ties to the lower expert id, unused slots ``-1`` with weight 0
* optional ``moe_experts(x, expert_idx, expert_w, w13, w2)`` = the weighted sum of the chosen experts' MLPs, or None

Every result keeps the input's dtype and shape and stays within :data:`TOLERANCES` of float64 math on the same
(rounded) inputs. With ``deterministic=True`` every row of ``linear`` must equal that row computed alone, bit for bit.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from litellm_pipeline.registry.types import RoutePlan
from litellm_pipeline.testing._support import (
    DEMO_PROMPTS,
    build_llm,
    config_name,
    describe,
    resolve,
)

# (atol, rtol) against float64 math; linear's atol is scaled by sqrt(K) (the size of a sum of K rounded
# products). The half types round every output (2^-8 relative for bfloat16) and may round intermediate steps too.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Rand:
    def __init__(self, seed: int, dtype: torch.dtype, device):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, device

    def __call__(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g) * scale).to(device=self.device, dtype=self.dtype)


def _close(what: str, got: Any, want: torch.Tensor, like: torch.Tensor, atol_scale: float = 1.0) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: returned {type(got).__name__}, not a tensor"
    assert got.shape == want.shape and got.dtype == like.dtype, (
        f"{what}: returned shape {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {like.dtype}"
    )
    atol, rtol = TOLERANCES.get(like.dtype, TOLERANCES[torch.float32])
    diff = (got.double() - want).abs()
    excess = diff - rtol * want.abs() - atol * atol_scale
    if not (excess <= 0).all():  # also catches NaN
        i = int(torch.nan_to_num(excess, nan=float("inf")).argmax())
        raise AssertionError(
            f"{what}: differs from the float64 reference by up to {float(diff.max()):.3g} (tolerance "
            f"{atol * atol_scale:.3g} + {rtol:g}*|ref|); first worst element {i}: got {float(got.flatten()[i])!r}, "
            f"reference {float(want.flatten()[i])!r}"
        )


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _check_linear(ops, name: str, r: _Rand, deterministic: bool) -> None:
    for rows in (1, 2, 3, 5, 17, 40):
        for out_f, in_f in ((37, 45), (96, 64)):
            x, w, b = r(rows, in_f), r(out_f, in_f), r(out_f)
            for bias in (None, b):
                want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                what = f"layer_ops {name}.linear, x [{rows}, {in_f}], w [{out_f}, {in_f}], bias {bias is not None}, {x.dtype}"
                got = ops.linear(x, w, bias)
                _close(what, got, want, x, atol_scale=in_f**0.5)
                if deterministic and rows > 1:
                    alone = torch.cat([ops.linear(x[i : i + 1], w, bias) for i in range(rows)])
                    diff = (alone != got).any(-1).nonzero().flatten().tolist()
                    assert not diff, (
                        f"{what}, deterministic=True: rows {diff} differ from the same rows computed alone (the "
                        "batch-invariant mode needs every row's arithmetic independent of the others)"
                    )
    wide = r(5, 200)[:, :64]  # rows that are not contiguous with each other
    w = r(16, 64)
    _close(f"layer_ops {name}.linear on a strided x [5, 64] ({wide.dtype})", ops.linear(wide, w),
           F.linear(wide.double(), w.double()), wide, atol_scale=8.0)


def _check_norms(ops, name: str, r: _Rand) -> None:
    x, w = r(7, 3, 64, scale=3.0), r(64)
    _close(f"layer_ops {name}.rms_norm on [7, 3, 64] ({x.dtype})", ops.rms_norm(x, w, 1e-6), _rms(x, w, 1e-6), x)
    strided, w96 = r(5, 200)[:, :96], r(96)
    _close(f"layer_ops {name}.rms_norm on a strided [5, 96] ({x.dtype})", ops.rms_norm(strided, w96, 1e-5),
           _rms(strided, w96, 1e-5), strided)
    h, res = r(5, 96), r(5, 96)
    got = ops.add_rms_norm(h, res, w96, 1e-5)
    assert isinstance(got, tuple) and len(got) == 2, f"layer_ops {name}.add_rms_norm must return (sum, normed)"
    s = (h + res)  # the sum in the activation dtype: what the next layer's residual must be
    _close(f"layer_ops {name}.add_rms_norm sum ({x.dtype})", got[0], h.double() + res.double(), h)
    _close(f"layer_ops {name}.add_rms_norm normed ({x.dtype})", got[1], _rms(s, w96, 1e-5), h)


def _check_silu_rotary(ops, name: str, r: _Rand) -> None:
    gu = r(6, 100, scale=4.0)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0], dtype=gu.dtype)  # exp must neither overflow nor NaN
    g, u = gu.double().chunk(2, dim=-1)
    _close(f"layer_ops {name}.silu_mul ({gu.dtype})", ops.silu_mul(gu), F.silu(g) * u, gu)
    t, hq, hk, d = 9, 4, 2, 16
    qkv = r(t, (hq + 2 * hk) * d)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(t, hq, d), k.reshape(t, hk, d)  # views into one fused projection, as the model has them
    angle = torch.randn(t, d // 2, generator=r.g) * 3
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(device=r.device, dtype=r.dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(device=r.device, dtype=r.dtype)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    want_q = q.double() * c + _rotate_half(q.double()) * s  # before the call: it may rotate in place
    want_k = k.double() * c + _rotate_half(k.double()) * s
    got = ops.rotary(q, k, cos, sin)
    assert isinstance(got, tuple) and len(got) == 2, f"layer_ops {name}.rotary must return (q, k)"
    _close(f"layer_ops {name}.rotary q ({q.dtype})", got[0], want_q, q, atol_scale=2.0)
    _close(f"layer_ops {name}.rotary k ({q.dtype})", got[1], want_k, q, atol_scale=2.0)


def _check_residual_mlp(ops, name: str, r: _Rand) -> None:
    from litellm_pipeline.model.layers import GatedMLP

    hidden, inter = 32, 48
    mlp = GatedMLP(hidden, inter).to(device=r.device, dtype=r.dtype)
    with torch.no_grad():
        mlp.gate_up_proj.copy_(r(2 * inter, hidden, scale=0.2))
        mlp.down_proj.copy_(r(hidden, inter, scale=0.2))
    mlp.ops = ops  # what binding the model does
    h, x = r(6, hidden), r(6, hidden)
    gu = x.double() @ mlp.gate_up_proj.double().T
    g, u = gu.chunk(2, dim=-1)
    want = h.double() + (F.silu(g) * u) @ mlp.down_proj.double().T
    _close(f"layer_ops {name}.residual_mlp ({x.dtype})", ops.residual_mlp(h, x, mlp), want, x, atol_scale=8.0)


def _route_plans(t: int, e: int, g: torch.Generator, device) -> list[RoutePlan | None]:
    top_k = torch.randint(1, 5, (t,), generator=g).to(device)
    allowed = torch.rand(t, e, generator=g) > 0.3
    allowed[:, :4] = True  # at least max_k experts allowed per token
    allowed = allowed[:, torch.randperm(e, generator=g)].to(device)
    return [None, RoutePlan(max_k=3), RoutePlan(top_k=top_k, max_k=4), RoutePlan(top_k=top_k, max_k=4, allowed=allowed),
            RoutePlan(max_k=4, allowed=allowed)]


def _check_route(ops, name: str, r: _Rand) -> None:
    t, e, hdim, native = 40, 8, 32, 2
    x, gate = r(t, hdim), r(e, hdim)
    probs = F.softmax(x.double() @ gate.double().T, dim=-1)
    atol = TOLERANCES.get(x.dtype, TOLERANCES[torch.float32])[0] * 2  # the router's logits round in x's dtype
    for plan in _route_plans(t, e, r.g, r.device):
        for normalize in (True, False):
            what = f"layer_ops {name}.route ({x.dtype}, plan {plan}, normalize {normalize})"
            got = ops.route(x, gate, native, normalize, plan)
            assert isinstance(got, tuple) and len(got) == 2, f"{what}: must return (expert_idx, expert_w)"
            _check_routing(what, got[0], got[1], probs, native, normalize, plan, atol)
    # exact ties resolve to the lower expert id: experts 2 and 5 share a gate row and beat every other; small
    # integers times 0.5 sum exactly in any order, so the two scores are equal whatever the arithmetic
    xp = torch.randint(0, 4, (t, hdim), generator=r.g).to(device=r.device, dtype=r.dtype)
    tie = torch.full((e, hdim), -0.25, dtype=r.dtype, device=r.device)
    tie[2] = tie[5] = 0.5
    idx, _ = ops.route(xp, tie, 1, True, None)
    picked = sorted(set(idx[:, 0].tolist()))
    assert picked == [2], f"layer_ops {name}.route: equal scores of experts 2 and 5 must pick 2 (got experts {picked})"


def _check_routing(what, idx, w, probs, native, normalize, plan, atol) -> None:
    t, e = probs.shape
    k = min(native if plan is None or plan.max_k is None else plan.max_k, e)
    assert idx.shape == (t, k) and w.shape == (t, k), f"{what}: expected [{t}, {k}] indices and weights, got " \
        f"{tuple(idx.shape)} and {tuple(w.shape)}"
    allowed = plan.allowed.cpu() if plan is not None and plan.allowed is not None else torch.ones(t, e, dtype=torch.bool)
    used_n = plan.top_k.cpu().tolist() if plan is not None and plan.top_k is not None else [k] * t
    idx, w = idx.cpu(), w.double().cpu()
    p = probs.cpu().masked_fill(~allowed, 0.0)
    for i in range(t):
        n = min(used_n[i], k)
        used, rest = idx[i, :n].tolist(), idx[i, n:].tolist()
        assert all(x == -1 for x in rest) and bool((w[i, n:] == 0).all()), (
            f"{what}: token {i} may use {n} experts; slots after those must be -1 with weight 0 (got {idx[i].tolist()})"
        )
        assert len(set(used)) == n and all(0 <= x < e and bool(allowed[i, x]) for x in used), (
            f"{what}: token {i} must use {n} distinct experts of its TierSet {allowed[i].nonzero().flatten().tolist()}, "
            f"got {used}"
        )
        nth = p[i].sort(descending=True).values[n - 1]
        assert all(p[i, x] >= nth - atol for x in used), (
            f"{what}: token {i} chose {used} but those are not its {n} most probable allowed experts "
            f"(probabilities {[round(float(p[i, x]), 5) for x in used]}, the {n}-th highest is {float(nth):.5f})"
        )
        want = p[i, used]
        if normalize:
            want = want / want.sum()
        assert torch.allclose(w[i, :n], want, atol=atol, rtol=0), (
            f"{what}: token {i} weights {w[i, :n].tolist()} != its experts' "
            f"{'renormalised ' if normalize else ''}probabilities {want.tolist()}"
        )


def _check_moe_experts(ops, name: str, r: _Rand) -> None:
    run = getattr(ops, "moe_experts", None)
    if run is None:
        return
    t, e, hdim, inter, k = 12, 6, 32, 24, 3
    x = r(t, hdim)
    w13, w2 = r(e, 2 * inter, hdim, scale=0.2), r(e, hdim, inter, scale=0.2)
    idx = torch.stack([torch.randperm(e, generator=r.g)[:k] for _ in range(t)]).to(r.device)
    idx[::4, -1] = -1  # unused slots
    w = torch.rand(t, k, generator=r.g).to(r.device)
    got = run(x, idx, w, w13, w2)
    if got is None:  # "does not apply here": the fused dispatch then runs the packed one
        return
    want = torch.zeros(t, hdim, dtype=torch.float64, device=r.device)
    for i in range(t):
        for j in range(k):
            ex = int(idx[i, j])
            if ex < 0:
                continue
            g, u = (x[i].double() @ w13[ex].double().T).chunk(2)
            want[i] += float(w[i, j]) * ((F.silu(g) * u) @ w2[ex].double().T)
    _close(f"layer_ops {name}.moe_experts ({x.dtype})", got, want, x, atol_scale=8.0)


def _check_in_engine(cls_or_name, name: str) -> None:
    """The demo model (MoE, q/k norms) with these ops: the reference ops' greedy tokens, logprobs within 1e-3."""
    from litellm_pipeline.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    runs = {}
    with config_name("layer_ops", cls_or_name) as cfg_name:
        for label, ops_name in (("reference", "torch"), ("checked", cfg_name)):
            llm = build_llm([f"pipeline.stages.decode.params.layer_ops={ops_name}"])
            outs = llm.generate(list(DEMO_PROMPTS), params)
            runs[label] = [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
    for prompt, (ref_ids, ref_lp), (ids, lp) in zip(DEMO_PROMPTS, runs["reference"], runs["checked"]):
        assert ids == ref_ids, (
            f"layer_ops {name} in the demo model: greedy tokens for {prompt!r} are {ids}, the torch reference ops "
            f"give {ref_ids}"
        )
        worst = max(abs(a - b) for a, b in zip(lp, ref_lp))
        assert worst <= 1e-3, f"layer_ops {name} in the demo model: logprobs for {prompt!r} differ by {worst:.3g} (> 1e-3)"


def check_layer_ops(
    impl: str | type,
    *,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    device: str | torch.device = "cpu",
    engine: bool = True,
    seed: int = 0,
) -> None:
    """Check a ``layer_ops`` class (a registry name or the class) op by op against float64 math in every dtype of
    ``dtypes``: linear (1-40 rows, with and without bias, strided input), rms_norm, add_rms_norm, silu_mul (with
    extreme inputs), rotary (on views of a fused projection), residual_mlp, route (TierSet limits, per-token
    top-k, ties to the lower id) and, if the class has it, moe_experts. A class whose ``__init__`` takes
    ``deterministic`` is also built with ``deterministic=True`` and checked for batch invariance of ``linear``.
    With ``engine=True`` the demo model runs with it on ``device``=cpu and must give the reference ops' greedy
    tokens. Raises ``AssertionError`` naming the op, shapes and dtype.
    """
    cls: Callable = resolve("layer_ops", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    variants = [(cls(), False)]
    try:
        takes_det = "deterministic" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        takes_det = False
    if takes_det:
        variants.append((cls(deterministic=True), True))
    for n, dtype in enumerate(dtypes):
        for ops, det in variants:
            label = f"{name}{' (deterministic)' if det else ''}"
            r = _Rand(seed * 100 + n, dtype, device)
            _check_linear(ops, label, r, det)
            _check_norms(ops, label, r)
            _check_silu_rotary(ops, label, r)
            _check_residual_mlp(ops, label, r)
            _check_route(ops, label, r)
            _check_moe_experts(ops, label, r)
    if engine and torch.device(device).type == "cpu":
        _check_in_engine(impl, name)
