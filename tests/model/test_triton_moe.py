"""moe_dispatch triton_fused: the grouped-GEMM Triton kernels against ``packed`` and the float64 sum of experts.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from litellm_pipeline import registry  # noqa: E402
from litellm_pipeline.model import triton_moe  # noqa: E402
from litellm_pipeline.model.layer_ops import TorchLayerOps  # noqa: E402
from litellm_pipeline.model.moe import packed_dispatch  # noqa: E402
from litellm_pipeline.model.triton_common import interpreting  # noqa: E402
from litellm_pipeline.model.triton_moe import triton_fused_dispatch  # noqa: E402
from litellm_pipeline.testing.layer_ops import TOLERANCES  # noqa: E402
from litellm_pipeline.testing.moe_dispatch import _reference, check_moe_dispatch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_EXPERTS = 8
# (tokens, slots, hidden, intermediate): H/I not powers of 2; the last one spans several K and N blocks
CASES = ((1, 1, 40, 24), (6, 2, 40, 24), (19, 3, 40, 24), (40, 4, 40, 24), (33, 2, 136, 72))


def _problem(g, t, k, hdim, inter, dtype):
    """Weights and a routing: expert 7 never picked, per-token k from 0 to ``k`` and holes anywhere."""
    x = torch.randn(t, hdim, generator=g)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hdim, generator=g) * 0.2
    w2 = torch.randn(NUM_EXPERTS, hdim, inter, generator=g) * 0.2
    idx = torch.stack([torch.randperm(NUM_EXPERTS - 1, generator=g)[:k] for _ in range(t)])
    kt = torch.randint(0, k + 1, (t,), generator=g)
    kt[0] = k  # some token uses every slot
    idx[torch.arange(k)[None, :] >= kt[:, None]] = -1  # a tier plan's per-token limit: trailing -1
    idx[torch.rand(t, k, generator=g) < 0.1] = -1  # and holes in the middle
    w = torch.rand(t, k, generator=g)
    return [a.to(dtype) for a in (x, w13, w2)] + [idx, w]


def _to(dev, *ts):
    return [t.to(dev) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_fused_matches_packed_and_float64(dtype):
    g = torch.Generator().manual_seed(7)
    ops = TorchLayerOps()
    atol, rtol = TOLERANCES[dtype]
    for i, (t, k, hdim, inter) in enumerate(CASES):
        x, w13, w2, idx, w = _problem(g, t, k, hdim, inter, dtype)
        if i == 2:  # a strided x (a view into a wider buffer)
            x = torch.cat([x, x], dim=1)[:, :hdim]
        want = _reference(x, idx, w, w13, w2)
        ref = packed_dispatch(x, idx, w, w13, w2, ops).double()
        got = triton_fused_dispatch(*_to(DEV, x, idx, w, w13, w2), ops).cpu()
        what = f"{t} tokens top-{k} H={hdim} I={inter} {dtype}"
        assert got.shape == x.shape and got.dtype == dtype, what
        assert torch.isfinite(got).all(), what
        err = ((got.double() - want).abs() - rtol * want.abs()).max()
        assert err <= atol * 8, f"{what}: {float((got.double() - want).abs().max()):.3g} from float64"
        err = ((got.double() - ref).abs() - 2 * rtol * ref.abs()).max()
        assert err <= atol * 16, f"{what}: {float((got.double() - ref).abs().max()):.3g} from packed"
        unused = (idx < 0).all(dim=1)
        assert (got[unused] == 0).all(), f"{what}: a token with no expert must get zeros"


def test_triton_fused_groups_past_one_block_and_is_deterministic():
    g = torch.Generator().manual_seed(3)
    x, w13, w2, _, w = _problem(g, 40, 4, 40, 24, torch.float32)
    # every token picks expert 0 (40 rows: three blocks of 16), then three of experts 1..6; expert 7 nobody
    idx = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(6, generator=g)[:3] + 1])
                       for _ in range(40)])
    idx[5::4, 2] = -1
    want = _reference(x, idx, w, w13, w2)
    got = triton_fused_dispatch(*_to(DEV, x, idx, w, w13, w2), None)
    atol, rtol = TOLERANCES[torch.float32]
    assert ((got.cpu().double() - want).abs() - rtol * want.abs()).max() <= atol * 8
    assert torch.equal(got, triton_fused_dispatch(*_to(DEV, x, idx, w, w13, w2), None))


def test_triton_align_block_size_pads_each_expert():
    idx = torch.tensor([[2, 0], [-1, 2], [2, -1], [5, 0]])
    sorted_ids, block_expert = triton_moe.align_block_size(idx.reshape(-1), NUM_EXPERTS, 6, 4)
    n = idx.numel()
    # expert 0: pairs 1, 7; expert 2: 0, 3, 4; expert 5: 6; then spare blocks (an upper bound)
    assert block_expert.tolist() == [0, 2, 5, -1, -1, -1]
    assert sorted_ids.tolist() == [1, 7, n, n, 0, 3, 4, n, 6] + [n] * 15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitwise batch invariance needs the compiled kernels: "
                    "the interpreter's numpy matmul rounds a row differently by its place in the tile")
def test_triton_fused_token_result_does_not_depend_on_batch():
    g = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        x, w13, w2, idx, w = _to("cuda", *_problem(g, 33, 2, 136, 72, dtype))
        full = triton_fused_dispatch(x, idx, w, w13, w2, None)
        for i in range(0, 33, 4):
            alone = triton_fused_dispatch(x[i : i + 1], idx[i : i + 1], w[i : i + 1], w13, w2, None)
            assert torch.equal(alone, full[i : i + 1]), f"token {i} alone differs from in the batch ({dtype})"


def test_triton_fused_empty_batch_returns_zeros_without_launching(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a kernel for an empty batch")

    monkeypatch.setattr(triton_moe, "_gate_up_kernel", NoLaunch())
    monkeypatch.setattr(triton_moe, "_down_kernel", NoLaunch())
    g = torch.Generator().manual_seed(1)
    x, w13, w2, idx, w = _to(DEV, *_problem(g, 5, 2, 40, 24, torch.bfloat16))
    out = triton_fused_dispatch(x, torch.full_like(idx, -1), w, w13, w2, None)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and (out == 0).all()
    out = triton_fused_dispatch(x[:0], idx[:0], w[:0], w13, w2, None)
    assert out.shape == (0, 40) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not interpreting(), reason="the kit runs CPU tensors: only under Triton's interpreter")
def test_triton_fused_passes_conformance_kit():
    check_moe_dispatch("triton_fused", dtypes=DTYPES)  # kernels in three dtypes, then the demo model vs packed


def test_triton_fused_is_listed_and_loads_from_registry():
    assert "triton_fused" in registry.names("moe_dispatch")
    assert registry.get("moe_dispatch", "triton_fused") is triton_fused_dispatch
    assert registry.origin("moe_dispatch", "triton_fused").builtin


def test_triton_fused_cpu_tensor_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(2)
    x, w13, w2, idx, w = _problem(g, 3, 2, 40, 24, torch.float32)
    with pytest.raises(RuntimeError, match=r"moe_dispatch triton_fused.*CUDA tensors.*TRITON_INTERPRET=1"):
        triton_fused_dispatch(x, idx, w, w13, w2, TorchLayerOps())


def test_triton_fused_refuses_mixed_dtypes():
    g = torch.Generator().manual_seed(4)
    x, w13, w2, idx, w = _to(DEV, *_problem(g, 3, 2, 40, 24, torch.float32))
    with pytest.raises(TypeError, match="must share a dtype"):
        triton_fused_dispatch(x.half(), idx, w, w13, w2, None)
