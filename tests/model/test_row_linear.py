"""row_linear, the batch-invariant linear: a row's result is the same alone and in any batch, on every path
(AMX tiles, vdpbf16ps, float32 FMA), for shapes with ragged tails, and close to the float64 reference."""

from __future__ import annotations

import pytest
import torch

from litellm_pipeline.model import cpu_kernels


@pytest.fixture(scope="module")
def ops():
    try:
        ns = cpu_kernels.ops()
    except Exception as exc:  # no compiler here: the torch fallbacks are tested elsewhere
        pytest.skip(f"C++ kernels unavailable: {exc}")
    if not ns.small_linear_supported():
        pytest.skip("this build has no AVX-512 or AVX2 kernels")
    return ns


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("K,O", [(768, 2304), (100, 37), (33, 17), (64, 48), (31, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_alone_equal_rows_in_any_batch(ops, dtype, K, O, with_bias):
    g = torch.Generator().manual_seed(K * 1000 + O)
    w = torch.randn(O, K, generator=g).to(dtype)
    b = torch.randn(O, generator=g).to(dtype) if with_bias else None
    x = torch.randn(41, K, generator=g).to(dtype)
    y = ops.row_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]  # 16-bit: one output rounding
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    alone = torch.cat([ops.row_linear(x[i : i + 1].contiguous(), w, b) for i in range(len(x))])
    assert torch.equal(alone, y)  # bit for bit
    for lo, hi in ((3, 20), (16, 33), (40, 41)):  # other batch sizes, other positions in the tiles
        assert torch.equal(ops.row_linear(x[lo:hi].contiguous(), w, b), y[lo:hi])


def test_nan_in_a_neighbouring_row_of_the_weights_stays_out(ops):
    # ragged k blocks are copied, never read past a weight row: a NaN in the next row must not leak in
    w = torch.randn(3, 40).bfloat16()
    w[1] = float("nan")
    x = torch.randn(5, 40).bfloat16()
    y = ops.row_linear(x, w, None)
    assert torch.isfinite(y[:, 0]).all() and torch.isfinite(y[:, 2]).all() and torch.isnan(y[:, 1]).all()


def test_the_path_is_reported(ops):
    assert ops.row_linear_path() in ("amx", "avx512_bf16", "avx512", "avx2")
    assert (ops.row_linear_path() == "avx2") == (ops.simd_isa() == "avx2")
