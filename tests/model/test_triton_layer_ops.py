"""layer_ops ``triton``: each kernel against the torch reference (odd and non-power-of-2 sizes, 1-17 tokens, strided
views of a fused qkv, float32/bfloat16/float16), batch invariance, the torch fallbacks, the conformance kit with the
demo engine, the registry entry, and the error for CPU tensors without Triton's interpreter.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): slow, so the
shapes are small. On a CUDA machine the same tests run compiled on the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from litellm_pipeline import registry  # noqa: E402
from litellm_pipeline.model.layer_ops import TorchLayerOps  # noqa: E402
from litellm_pipeline.model.layers import GatedMLP  # noqa: E402
from litellm_pipeline.model.triton_ops import MAX_BLOCK_I, TritonLayerOps  # noqa: E402
from litellm_pipeline.testing import check_layer_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REF = TorchLayerOps()
OPS = TritonLayerOps()
# How far a result may be from the torch reference, relative. The norms' float32 row sums and SiLU's exp may round
# differently from torch's; the products after them carry that last bit (measured: up to 3.5e-7 in float32). In half
# precision it rarely moves a rounding: the normalised row by one ulp, which the weight product can make two ulps of
# the result. On a GPU both sides use the hardware's approximate exp/rsqrt, so float32 gets the interface's 1e-5.
RTOL = {
    torch.float32: 1e-6 if DEVICE == "cpu" else 1e-5,
    torch.bfloat16: 2.0**-6,
    torch.float16: 2.0**-9,
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same shape and dtype, and every element within RTOL (relative) of the reference."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    rel = RTOL[want.dtype]
    torch.testing.assert_close(got, want, atol=rel * 1e-3, rtol=rel)


def _fused_qkv(g, t: int, hq: int, hk: int, d: int, dtype):
    """q [t, hq, d], k [t, hk, d], v as strided views into one [t, (hq + 2hk) d] projection, as Attention has them."""
    qkv = _rand(g, t, (hq + 2 * hk) * d, dtype=dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return qkv, q.reshape(t, hq, d), k.reshape(t, hk, d), v


def _cos_sin(g, t: int, d: int, dtype):
    angle = torch.randn(t, d // 2, generator=g) * 3
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((cos, cos), -1).to(DEVICE, dtype), torch.cat((sin, sin), -1).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    cases = [
        _rand(g, 1, 40, dtype=dtype, scale=3.0),
        _rand(g, 17, 96, dtype=dtype),
        _rand(g, 7, 3, 64, dtype=dtype, scale=3.0),
        _rand(g, 40, dtype=dtype),  # a single 1-D row
        _rand(g, 5, 200, dtype=dtype)[:, :96],  # rows not contiguous with each other
        _rand(g, 3, 4, 5, 24, dtype=dtype).permute(2, 0, 1, 3),  # three leading dims that do not collapse: copied
        _rand(g, 1, 7, dtype=dtype),  # a row narrower than a tile, width 7
    ]
    _, q, k, _ = _fused_qkv(g, 9, 4, 2, 24, dtype)  # the per-head q/k norm on the fused projection's views
    cases += [q, k]
    for x in cases:
        w = _rand(g, x.shape[-1], dtype=dtype)
        before = x.clone()
        _near(OPS.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
        assert torch.equal(x, before), "rms_norm must not modify its input"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_add_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    for t, h in ((1, 40), (5, 96), (17, 40), (3, 33)):
        x, res, w = _rand(g, t, h, dtype=dtype), _rand(g, t, h, dtype=dtype, scale=2.0), _rand(g, h, dtype=dtype)
        s, normed = OPS.add_rms_norm(x, res, w, 1e-5)
        s_ref, normed_ref = REF.add_rms_norm(x, res, w, 1e-5)
        assert torch.equal(s, s_ref)  # one rounded add: bit for bit in every dtype
        _near(normed, normed_ref)
    wide = _rand(g, 6, 150, dtype=dtype)
    x, res, w = wide[:, :96], wide[:, 50:146], _rand(g, 96, dtype=dtype)  # strided rows
    s, normed = OPS.add_rms_norm(x, res, w, 1e-5)
    s_ref, normed_ref = REF.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(s, s_ref)
    _near(normed, normed_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    extreme = _rand(g, 6, 2 * 50, dtype=dtype, scale=4.0)
    extreme[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(extreme)  # exp overflows to inf: no NaN
    cases = [
        _rand(g, 1, 2 * 40, dtype=dtype, scale=4.0),
        _rand(g, 17, 2 * 96, dtype=dtype, scale=4.0),
        _rand(g, 3, 5, 2 * 24, dtype=dtype),  # 3-D
        _rand(g, 4, 300, dtype=dtype)[:, : 2 * 37],  # strided rows, odd I
        _rand(g, 2, 2 * (MAX_BLOCK_I + 77), dtype=dtype),  # I wider than a column block: two column programs
        extreme,
    ]
    for gu in cases:
        got = OPS.silu_mul(gu)
        assert not got.isnan().any()
        _near(got, REF.silu_mul(gu))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 2, 16), (9, 3, 1, 96), (17, 2, 2, 40)])
def test_triton_rotary_matches_torch_on_fused_qkv_views(dtype, t, hq, hk, d):
    g = torch.Generator().manual_seed(t * 100 + d)
    qkv, q, k, v = _fused_qkv(g, t, hq, hk, d, dtype)
    cos, sin = _cos_sin(g, t, d, dtype)
    v_before = v.clone()
    q_ref, k_ref = REF.rotary(q.clone(), k.clone(), cos, sin)
    q_out, k_out = OPS.rotary(q, k, cos, sin)
    # pure IEEE products and sums in the reference's order: bit for bit in every dtype, float32 included
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # rotated in place
    assert torch.equal(v, v_before), "rotary wrote outside q and k"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_rotary_casts_float32_cos_sin_like_the_reference(dtype):
    g = torch.Generator().manual_seed(4)
    _, q, k, _ = _fused_qkv(g, 5, 4, 2, 24, dtype)
    cos, sin = _cos_sin(g, 5, 24, torch.float32)
    q_ref, k_ref = REF.rotary(q.clone(), k.clone(), cos, sin)
    q_out, k_out = OPS.rotary(q, k, cos, sin)
    assert q_out.dtype == dtype and torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_triton_ops_are_batch_invariant():
    """Deterministic mode: a row's result is bit-identical alone and inside a batch (the tiles depend on the
    row width only)."""
    ops = TritonLayerOps(deterministic=True)
    assert ops.deterministic
    g = torch.Generator().manual_seed(5)
    f32 = torch.float32
    x, res, w = _rand(g, 13, 96, dtype=f32), _rand(g, 13, 96, dtype=f32), _rand(g, 96, dtype=f32)
    normed = ops.rms_norm(x, w, 1e-6)
    s, added = ops.add_rms_norm(x, res, w, 1e-6)
    gu = _rand(g, 13, 2 * 40, dtype=f32)
    act = ops.silu_mul(gu)
    for i in (0, 6, 12):
        assert torch.equal(ops.rms_norm(x[i : i + 1], w, 1e-6), normed[i : i + 1])
        s_i, added_i = ops.add_rms_norm(x[i : i + 1], res[i : i + 1], w, 1e-6)
        assert torch.equal(s_i, s[i : i + 1]) and torch.equal(added_i, added[i : i + 1])
        assert torch.equal(ops.silu_mul(gu[i : i + 1]), act[i : i + 1])
    _, q, k, _ = _fused_qkv(g, 7, 4, 2, 16, torch.float32)
    cos, sin = _cos_sin(g, 7, 16, torch.float32)
    q1, k1 = q[3:4].clone(), k[3:4].clone()
    q_all, k_all = ops.rotary(q, k, cos, sin)
    q_one, k_one = ops.rotary(q1, k1, cos[3:4], sin[3:4])
    assert torch.equal(q_one, q_all[3:4]) and torch.equal(k_one, k_all[3:4])


def test_triton_residual_mlp_runs_silu_mul_through_self():
    g = torch.Generator().manual_seed(6)
    mlp = GatedMLP(40, 24).to(DEVICE)
    with torch.no_grad():
        mlp.gate_up_proj.copy_(_rand(g, 48, 40, dtype=torch.float32, scale=0.2))
        mlp.down_proj.copy_(_rand(g, 40, 24, dtype=torch.float32, scale=0.2))
    h, x = _rand(g, 5, 40, dtype=torch.float32), _rand(g, 5, 40, dtype=torch.float32)
    calls = []

    class Counting(TritonLayerOps):
        def silu_mul(self, gate_up):
            calls.append(tuple(gate_up.shape))
            return super().silu_mul(gate_up)

    with torch.no_grad():
        got = Counting().residual_mlp(h, x, mlp)  # mlp.ops is still the reference: residual_mlp must not use it
        want = REF.residual_mlp(h, x, mlp)
    assert calls == [(5, 48)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_triton_ops_fall_back_to_torch_where_the_kernels_do_not_apply():
    g = torch.Generator().manual_seed(7)
    empty = torch.empty(0, 40, device=DEVICE)
    w = _rand(g, 40, dtype=torch.float32)
    assert OPS.rms_norm(empty, w, 1e-6).shape == (0, 40)
    s, normed = OPS.add_rms_norm(empty, empty, w, 1e-6)
    assert s.shape == normed.shape == (0, 40)
    assert OPS.silu_mul(torch.empty(0, 80, device=DEVICE)).shape == (0, 40)
    q, k = OPS.rotary(torch.empty(0, 4, 16, device=DEVICE), torch.empty(0, 2, 16, device=DEVICE),
                      torch.empty(0, 16, device=DEVICE), torch.empty(0, 16, device=DEVICE))
    assert q.shape == (0, 4, 16) and k.shape == (0, 2, 16)
    # float64 (no kernel) and a float32 weight on bfloat16 rows (torch promotes): the reference's results and dtypes
    x64 = _rand(g, 3, 40, dtype=torch.float64)
    assert torch.equal(OPS.rms_norm(x64, w.double(), 1e-6), REF.rms_norm(x64, w.double(), 1e-6))
    xb = _rand(g, 3, 40, dtype=torch.bfloat16)
    got = OPS.rms_norm(xb, w, 1e-6)
    assert got.dtype == torch.float32 and torch.equal(got, REF.rms_norm(xb, w, 1e-6))
    # an odd head dim has no rotate-half split the kernel takes
    q, k = _rand(g, 2, 2, 7, dtype=torch.float32), _rand(g, 2, 1, 7, dtype=torch.float32)
    c, s_ = _rand(g, 2, 7, dtype=torch.float32), _rand(g, 2, 7, dtype=torch.float32)
    q_ref, k_ref = REF.rotary(q, k, c, s_)
    q_out, k_out = OPS.rotary(q, k, c, s_)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_triton_layer_ops_pass_the_conformance_kit():
    """Every op in all three dtypes, both modes, and (on a CPU) the demo engine's greedy tokens and logprobs."""
    check_layer_ops("triton", device=DEVICE)


def test_triton_layer_ops_registry_lists_and_loads_it():
    assert "triton" in registry.names("layer_ops")
    assert registry.get("layer_ops", "triton") is TritonLayerOps
    assert str(registry.origin("layer_ops", "triton")) == "built-in"
    assert issubclass(TritonLayerOps, TorchLayerOps)
    assert TritonLayerOps(deterministic=True).deterministic and not TritonLayerOps().deterministic


def test_triton_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = torch.randn(2, 40), torch.randn(40)
    q, k, cos = torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.randn(2, 16)
    refused = r"layer_ops triton: Triton kernels run on CUDA tensors \(got cpu\)"
    for call in (
        lambda: OPS.rms_norm(x, w, 1e-6),
        lambda: OPS.add_rms_norm(x, x, w, 1e-6),
        lambda: OPS.silu_mul(x),
        lambda: OPS.rotary(q, k, cos, cos),
    ):
        with pytest.raises(RuntimeError, match=refused) as e:
            call()
        assert "TRITON_INTERPRET=1" in str(e.value) and "layer_ops cpu_fused" in str(e.value)
