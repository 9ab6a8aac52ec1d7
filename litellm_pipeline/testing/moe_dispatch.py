"""check_moe_dispatch: a ``moe_dispatch`` function against the float64 sum of each token's chosen experts.

The contract (``litellm_pipeline/model/moe.py``): ``dispatch(x [T, H], expert_idx [T, K], expert_w [T, K], w13
[E, 2I, H], w2 [E, H, I], ops) -> out [T, H]`` = per token the weighted sum over its slots of expert
``down(silu(gate) * up)``, where a slot with index ``-1`` is unused, computed with the bound layer ``ops``
(``linear``, ``silu_mul``). Output in x's dtype, within the layer ops' tolerance of float64 math.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from litellm_pipeline.model.layer_ops import TorchLayerOps
from litellm_pipeline.testing._support import (
    DEMO_PROMPTS,
    build_llm,
    config_name,
    describe,
    resolve,
)
from litellm_pipeline.testing.layer_ops import TOLERANCES


def _reference(x, idx, w, w13, w2) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            g, u = (x[t].double() @ w13[e].double().T).chunk(2)
            out[t] += float(w[t, j]) * ((F.silu(g) * u) @ w2[e].double().T)
    return out


def check_moe_dispatch(impl: str | Callable, *, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                       engine: bool = True, seed: int = 0) -> None:
    """Check a ``moe_dispatch`` function (a registry name or the function) on random routings (1-40 tokens, top-1
    to top-4 of 8 experts, unused slots, experts nobody picked) in every dtype of ``dtypes`` with the reference
    layer ops; with ``engine=True`` the demo model (MoE) must give the ``packed`` dispatch's greedy tokens."""
    fn = resolve("moe_dispatch", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    ops = TorchLayerOps()
    g = torch.Generator().manual_seed(seed)
    hdim, inter, e = 32, 24, 8
    for dtype in dtypes:
        atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
        for t, k in ((1, 1), (5, 2), (17, 3), (40, 4)):
            x = torch.randn(t, hdim, generator=g).to(dtype)
            w13 = (torch.randn(e, 2 * inter, hdim, generator=g) * 0.2).to(dtype)
            w2 = (torch.randn(e, hdim, inter, generator=g) * 0.2).to(dtype)
            idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert 7: never chosen
            idx[1::3, -1] = -1  # unused slots (the first token always keeps its experts)
            w = torch.rand(t, k, generator=g)
            want = _reference(x, idx, w, w13, w2)
            got = fn(x, idx, w, w13, w2, ops)
            what = f"moe_dispatch {name} ({t} tokens, top-{k}, {dtype})"
            assert isinstance(got, torch.Tensor) and got.shape == x.shape and got.dtype == x.dtype, (
                f"{what}: must return a tensor like x {tuple(x.shape)} {x.dtype}, got "
                f"{getattr(got, 'shape', type(got))} {getattr(got, 'dtype', '')}"
            )
            err = ((got.double() - want).abs() - rtol * want.abs()).max()
            assert err <= atol * 8, (
                f"{what}: differs from the weighted sum of the chosen experts by up to "
                f"{float((got.double() - want).abs().max()):.3g} (tolerance {atol * 8:.3g} + {rtol:g}*|ref|)"
            )
    if engine:
        from litellm_pipeline.sampling import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        with config_name("moe_dispatch", impl) as cfg:
            runs = [[o.token_ids for o in build_llm([f"pipeline.stages.decode.params.moe_dispatch={d}",
                                                     "pipeline.stages.decode.params.layer_ops=torch"])
                     .generate(list(DEMO_PROMPTS), params)] for d in ("packed", cfg)]
        assert runs[0] == runs[1], f"moe_dispatch {name} in the demo model: greedy tokens {runs[1]}, packed {runs[0]}"
