"""layer_ops cpu_int8 (litellm_pipeline/model/int8_ops.py, csrc/int8_linear.cpp): the int8 kernel against float64
math, the quantization error bound, the demo model and a dense checkpoint end to end (tokens and logprob drift
against float32), int8 storage, offload refusal and batch invariance."""

from __future__ import annotations

import pytest
import torch

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.llm import LLM
from litellm_pipeline.model import cpu_kernels
from litellm_pipeline.model.int8_ops import (
    INT8_KERNEL_MAX_ROWS,
    Int8LayerOps,
    dequant_linear,
    int8_gemm_linear,
    quantize_rows,
)
from litellm_pipeline.model.layers import Attention, GatedMLP, SparseMoE
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.testing._support import DEMO_PROMPTS, build_llm

INT8 = ["pipeline.stages.decode.params.layer_ops=cpu_int8"]
# the demo skills' prompts plus more of the same kinds: the set the drift bounds below were measured on
PROMPTS = list(DEMO_PROMPTS) + [
    "copy:abc123=", "45+67=", "rev:hello=", "sort:5281=", "copy:xyz=", "9+9=", "rev:qwerty=", "sort:8642=",
    "copy:tokens=", "100+23=",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
# Measured on this set (2-core AMD EPYC, AVX2): int8 float32 14/16 prompts with the float32 greedy tokens, int8
# bfloat16 15/16 (plain bfloat16 without int8: 15/16); the diverging prompts differ only after the answer (past the
# skill's end, where the demo model's next-token margins are small). Max |logprob| drift on the shared token prefix:
# 0.097 (int8 float32), 0.133 (int8 bfloat16; plain bfloat16: 0.228). Asserted with margin:
MIN_SAME_TOKENS = {"float32": 12, "bfloat16": 12}
MAX_LOGPROB_DRIFT = {"float32": 0.3, "bfloat16": 0.4}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _quantized(o: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, k, generator=g)
    w[o // 2] = 0.0  # an all-zero row: scale 1, q 0
    q, s = quantize_rows(w)
    return w, q, s, g


def _bound(x: torch.Tensor, wd: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 accumulation of K exact products (|error| <= K * 2^-24 * sum|terms|, scale and bias one more
    rounding each), then one rounding to the output dtype (half an ulp: 2^-p relative)."""
    k = x.shape[1]
    mag = x.abs().double() @ wd.abs().t()
    out = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    return (k + 2) * 2.0**-24 * mag + out * ref.abs() + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_float64_of_the_dequantized_weights(ns, dtype):
    for k, o in ((37, 23), (131, 19), (8, 9)):
        w, q, s, g = _quantized(o, k, seed=k)
        wd = q.double() * s.double()[:, None]
        bias = torch.randn(o, generator=g).to(dtype)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 64, 65, 80):
            x = torch.randn(m, k, generator=g).to(dtype)
            for b in (None, bias):
                ref = x.double() @ wd.t() + (0 if b is None else b.double())
                tol = _bound(x, wd, ref, dtype)
                for name, y in (
                    ("int8_linear", ns.int8_linear(x, q, s, b)),
                    ("int8_linear_scalar", ns.int8_linear_scalar(x, q, s, b)),
                    ("dequant_linear", dequant_linear(x, q, s, b)),
                ):
                    assert y.dtype == dtype and y.shape == (m, o)
                    err = (y.double() - ref).abs()
                    assert (err <= tol).all(), (
                        f"{name} {dtype} M={m} K={k} O={o} bias={b is not None}: error {err.max():.3g} over bound"
                    )
    # a strided input (a column slice of a wider tensor) is copied, not misread
    x = torch.randn(5, 2 * 37).to(dtype)[:, ::2]
    w, q, s, _ = _quantized(23, 37, seed=1)
    assert torch.equal(ns.int8_linear(x, q, s, None), ns.int8_linear(x.contiguous(), q, s, None))


def test_kernel_rejects_bad_inputs(ns):
    _, q, s, _ = _quantized(8, 16, seed=0)
    with pytest.raises(RuntimeError, match="int8"):
        ns.int8_linear(torch.randn(2, 16), q.float(), s, None)
    with pytest.raises(RuntimeError, match="scale"):
        ns.int8_linear(torch.randn(2, 16), q, s.double(), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        ns.int8_linear(torch.randn(2, 15), q, s, None)


def test_quantization_round_trip():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 41, 77, generator=g) * torch.logspace(-3, 2, 41)[None, :, None]
    w[1, 5] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 41)
    assert q.abs().max() <= 127 and (q != -128).all()
    err = (w.double() - q.double() * s.double()[..., None]).abs()
    # half a step, plus the float32 rounding of w / scale (a few ulps of the step)
    assert (err <= s.double()[..., None] * (0.5 + 1e-6)).all(), f"round trip error {(err / s[..., None]).max():.4f} steps"
    nonzero = w.abs().amax(-1) > 0
    assert (q.abs().amax(-1)[nonzero] == 127).all()  # the largest entry of every row maps to +-127
    assert (q[1, 5] == 0).all() and s[1, 5] == 1.0


def _run(llm, prompts=PROMPTS, params=PARAMS):
    outs = llm.generate(list(prompts), params)
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def _compare(ref, got) -> tuple[int, float]:
    """(prompts with the same greedy tokens, max |logprob| difference over each prompt's shared token prefix:
    the same context, the same token)."""
    same, drift = 0, 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(ref, got):
        same += ids_a == ids_b
        for ta, tb, a, b in zip(ids_a, ids_b, lp_a, lp_b):
            if ta != tb:
                break
            drift = max(drift, abs(a - b))
    return same, drift


def _projection_bytes(model) -> tuple[int, set]:
    total, dtypes = 0, set()
    for m in model.modules():
        names = {Attention: ("qkv_proj", "o_proj"), GatedMLP: ("gate_up_proj", "down_proj"), SparseMoE: ("w13", "w2")}
        for cls, ns in names.items():
            if isinstance(m, cls):
                for n in ns:
                    p = getattr(m, n)
                    total += p.numel() * p.element_size()
                    dtypes.add(p.dtype)
    return total, dtypes


@pytest.fixture(scope="module")
def demo_float32():
    return _run(build_llm())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_model_int8_against_float32(dtype, demo_float32, capsys):
    llm = build_llm([*INT8, f"device.dtype={dtype}"])
    model = llm.engine.rt.model
    assert isinstance(model.ops, Int8LayerOps)
    # the whole-model decode call takes the int8 weights (with their scales) as it takes float ones
    assert model.fused_decode_layers is not None and all(layer.fused_decode is not None for layer in model.layers)
    same, drift = _compare(demo_float32, _run(llm))
    with capsys.disabled():
        print(f"\ncpu_int8 {dtype} demo model: {same}/{len(PROMPTS)} prompts with float32's greedy tokens, "
              f"max logprob drift {drift:.4f}")
    assert same >= MIN_SAME_TOKENS[dtype], f"int8 {dtype}: only {same}/{len(PROMPTS)} prompts keep float32's tokens"
    assert drift <= MAX_LOGPROB_DRIFT[dtype], f"int8 {dtype}: logprob drift {drift:.4f} > {MAX_LOGPROB_DRIFT[dtype]}"
    assert llm.engine.rt.pool.is_empty()


HEAD = "pipeline.stages.decode.params.layer_ops_params={lm_head: true}"


def test_lm_head_int8_on_request(demo_float32):
    """``layer_ops_params={lm_head: true}``: the LM head is int8 too (measured on the demo model: the same 14/16
    prompts and 0.094 drift as without it), and the logits stay float32."""
    llm = build_llm([*INT8, HEAD])
    model = llm.engine.rt.model
    assert model.ops.lm_head and model.lm_head.dtype == torch.int8 and model.embed_tokens.dtype == torch.float32
    assert model.int8_scales["lm_head"].shape == (model.lm_head.shape[0],)
    same, drift = _compare(demo_float32, _run(llm))
    assert same >= MIN_SAME_TOKENS["float32"] and drift <= MAX_LOGPROB_DRIFT["float32"]
    assert model.compute_logits(torch.randn(2, model.lm_head.shape[1])).dtype == torch.float32


def test_lm_head_int8_with_tied_embeddings(tmp_path):
    """Tied embeddings: the head gets its own int8 copy; the lookup keeps the float table."""
    model, first = tied_head_run(tmp_path, [*INT8, HEAD], torch.int8)
    assert first <= 0.5


def tied_head_run(tmp_path, layer_ops: list[str], qdtype: torch.dtype) -> tuple:
    """A tiny llama with tied embeddings under ``layer_ops`` (quantizing the head): checks that the head is a
    ``qdtype`` copy of its own and the lookup table stays float; returns ``(model, first-token logprob drift)``
    against the float32 run."""
    from litellm_pipeline.bench.checkpoints import write_random_checkpoint
    from litellm_pipeline.bench.models import resolve_model

    _, cfg = resolve_model("tiny_llama")
    path = str(write_random_checkpoint(tmp_path / "tied", {**cfg, "tie_word_embeddings": True}, 0))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 200, 31], [77, 3, 3, 140, 9, 12]]
    fp = LLM(model=path, overrides=["device.threads=1"]).generate(prompts, params)
    llm = LLM(model=path, overrides=["device.threads=1", *layer_ops])
    model = llm.engine.rt.model
    assert model.lm_head.dtype == qdtype and model.embed_tokens.dtype == torch.float32
    assert model.lm_head.data_ptr() != model.embed_tokens.data_ptr()
    got = llm.generate(prompts, params)
    first = max(abs(a.logprobs[0][a.token_ids[0]] - b.logprobs[0][a.token_ids[0]]) for a, b in zip(fp, got)
                if a.token_ids[0] == b.token_ids[0])
    return model, first


def test_layer_ops_params_are_checked():
    with pytest.raises(ConfigError, match=r"layer_ops_params \['nope'\].*'cpu_int8' takes "
                                          r"\['lm_head', 'activations'\]"):
        build_llm([*INT8, "pipeline.stages.decode.params.layer_ops_params={nope: 1}"])
    with pytest.raises(ConfigError, match=r"'deterministic' is set by engine\.deterministic"):
        build_llm([*INT8, "pipeline.stages.decode.params.layer_ops_params={deterministic: true}"])
    with pytest.raises(ConfigError, match=r"layer_ops_params must be a mapping .* \(got int 3\)"):
        build_llm([*INT8, "pipeline.stages.decode.params.layer_ops_params=3"])
    with pytest.raises(ConfigError, match=r"cpu_int8: activations must be int8 or float, got 'int4'"):
        build_llm([*INT8, "pipeline.stages.decode.params.layer_ops_params={activations: int4}"])
    with pytest.raises(ConfigError, match=r"engine\.deterministic needs activations: float"):
        build_llm([*INT8, "engine.deterministic=true",
                   "pipeline.stages.decode.params.layer_ops_params={activations: int8}"])
    with pytest.raises(ConfigError, match=r"layer_ops 'cpu_fused' takes no parameters"):
        build_llm(["pipeline.stages.decode.params.layer_ops_params={lm_head: true}"])


def _op_by_op(llm) -> None:
    """Switch the fused C++ paths off for this engine: every projection then goes through ``linear``."""
    from litellm_pipeline.model.layer_ops import TorchLayerOps

    model = llm.engine.rt.model
    ops = model.ops
    model.fused_decode_layers = None
    for layer in model.layers:
        layer.fused_decode = None
    ops.moe_experts = lambda *args: None
    ops.residual_mlp = lambda h, x, mlp: TorchLayerOps.residual_mlp(ops, h, x, mlp)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_int8_paths_equal_op_by_op(dtype, hf_checkpoint):
    """The whole-model decode call, the fused attention block, MLP and MoE experts over int8 weights give the
    bits of the op-by-op path (the same kernels in the same order), on the MoE demo model and a dense checkpoint."""
    over = [*INT8, HEAD, f"device.dtype={dtype}"]
    for make in (lambda extra: build_llm(extra),
                 lambda extra: LLM(model=str(hf_checkpoint("llama")), overrides=["device.threads=1", *extra])):
        fused, plain = make(over), make(over)
        _op_by_op(plain)
        model = fused.engine.rt.model
        ran = {"layers": [], "tokens": []}

        limit = model.ops.max_rows[getattr(torch, dtype)]

        def spy(whole, calls, rows_arg):  # the whole-model call (from the step's metadata, or its tokens)
            def call(*args, **kw):
                out = whole(*args, **kw)
                if args[rows_arg].shape[0] <= limit:  # a prompt's rows past the kernel's limit: the general path
                    calls.append(out is not None)
                return out
            return call

        model.fused_decode_layers = spy(model.fused_decode_layers, ran["layers"], 1)  # (model, h, ...)
        model.decode_tokens = spy(model.decode_tokens, ran["tokens"], 0)  # (input_ids, ...)
        prompts = PROMPTS[:6] if model.cfg.is_moe else [[5, 9, 200, 31], [77, 3, 3, 140, 9, 12]]
        # no more rows than the whole-model call takes on this CPU (its float router's kernel limit for the dtype)
        prompts = prompts[:limit]
        assert _run(fused, prompts) == _run(plain, prompts)
        # every decode step runs in the one region, straight from its tokens, where the build has vector kernels;
        # without them the step from its tokens declines and the whole-model call runs op by op in C++
        team = cpu_kernels.ops().small_linear_supported()
        assert ran["tokens"] and all(r == team for r in ran["tokens"])
        assert all(ran["layers"]) and (team or ran["layers"])


def test_weights_are_int8_after_build():
    fp = build_llm()
    q8 = build_llm(INT8)
    fp_bytes, fp_dtypes = _projection_bytes(fp.engine.rt.model)
    q_bytes, q_dtypes = _projection_bytes(q8.engine.rt.model)
    assert fp_dtypes == {torch.float32} and q_dtypes == {torch.int8}
    # int8 payload: a quarter of float32 (the float32 scales, one per row, come on top: K times smaller)
    assert q_bytes * 4 == fp_bytes
    model = q8.engine.rt.model
    assert model.embed_tokens.dtype == torch.float32 and (model.lm_head is None or model.lm_head.dtype == torch.float32)
    for m in model.modules():
        if isinstance(m, SparseMoE):
            assert m.gate.dtype == torch.float32  # the router stays float
            assert m.int8_scales["w13"].shape == m.w13.shape[:2] and m.int8_scales["w13"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)


def test_dense_checkpoint(hf_checkpoint, capsys):
    """A dense HF checkpoint (tiny random llama) with cpu_int8 against its float32 run. Measured: 2/3 prompts keep
    the float32 greedy tokens (the third's first two candidates are 0.17 nats apart in float32 and swap), the
    chosen tokens' logprobs (shared prefix) drift by 0.166, the first step's top-5 logprobs by 0.29; bounds with margin."""
    path = str(hf_checkpoint("llama"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (4, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    fp = LLM(model=path, overrides=["device.threads=1"]).generate(prompts, params)
    llm = LLM(model=path, overrides=["device.threads=1", *INT8])
    model = llm.engine.rt.model
    assert isinstance(model.ops, Int8LayerOps) and not any(layer.is_moe for layer in model.layers)
    proj = {n: p.dtype for n, p in model.named_parameters() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    assert proj and set(proj.values()) == {torch.int8}
    q8 = llm.generate(prompts, params)
    same, drift = _compare(*[[(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
                             for outs in (fp, q8)])
    first = max(abs(a.logprobs[0][t] - b.logprobs[0][t]) for a, b in zip(fp, q8)
                for t in set(a.logprobs[0]) & set(b.logprobs[0]))
    with capsys.disabled():
        print(f"\ncpu_int8 dense llama checkpoint: {same}/{len(prompts)} prompts with float32's greedy tokens, "
              f"chosen-token logprob drift {drift:.4f}, first-step top-5 drift {first:.4f}")
    assert same >= 2
    assert drift <= 0.4 and first <= 0.6


def test_expert_offload_is_refused():
    with pytest.raises(ConfigError, match=r"moe\.hot_experts") as info:
        build_llm(["moe.hot_experts=2", *INT8])
    assert "cpu_int8" in str(info.value)
    model = build_llm(["moe.hot_experts=2"]).engine.rt.model
    with pytest.raises(ValueError, match=r"expert offload \(moe\.hot_experts\)"):
        Int8LayerOps().prepare_weights(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before touching a weight


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_invariance(ns, deterministic):
    """A row alone and in a batch: the same bits (deterministic: at any row count; else up to the kernel's rows)."""
    ops = Int8LayerOps(deterministic=deterministic)
    lin = torch.nn.Linear(48, 37, bias=True)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)

    holder = Holder()
    q, s = Int8LayerOps._quantize(holder.o_proj)
    ops._register(q, s)
    assert_batch_invariant(ops, q, lin.bias.detach(), 48, 80 if deterministic else INT8_KERNEL_MAX_ROWS)


def assert_batch_invariant(ops, q: torch.Tensor, bias: torch.Tensor, k: int, rows: int) -> None:
    """``ops.linear`` of quantized ``q`` on a row alone, on a prefix of the rows and on all ``rows``: the same bits."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k).to(dtype)
        full = ops.linear(x, q, bias.to(dtype))
        for i in (0, 1, 5, rows - 1):
            assert torch.equal(ops.linear(x[i : i + 1], q, bias.to(dtype)), full[i : i + 1]), (dtype, i)
            assert torch.equal(ops.linear(x[: i + 1], q, bias.to(dtype)), full[: i + 1]), (dtype, i)


def test_deterministic_engine_rows_alone_equal_batched():
    assert_deterministic_rows_alone_equal_batched(INT8, Int8LayerOps)


def assert_deterministic_rows_alone_equal_batched(layer_ops: list[str], cls) -> None:
    """``engine.deterministic`` with these layer ops: every prompt's tokens and logprobs alone equal batched."""
    llm = build_llm([*layer_ops, "engine.deterministic=true", "pipeline.stages.decode.params.attention=cpu_paged"])
    ops = llm.engine.rt.model.ops
    assert isinstance(ops, cls) and ops.deterministic
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    batched = _run(llm, PROMPTS[:6], params)
    alone = [_run(llm, [p], params)[0] for p in PROMPTS[:6]]
    assert batched == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_matches_float64_of_its_integer_arithmetic(dtype):
    """activations: int8: each row quantized on its own (max|x| / 127), exact int32 sums, then the two scales;
    against float64 of the same arithmetic, and within the activations' rounding of the exact product."""
    g = torch.Generator().manual_seed(11)
    w, q, s, _ = _quantized(37, 200, seed=4)
    bias = torch.randn(37, generator=g)
    x = (torch.randn(70, 200, generator=g) * torch.logspace(-2, 1, 70)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row: scale 0, output the bias
    y = int8_gemm_linear(x, q, s, bias.to(dtype))
    xf = x.double()
    sx = (x.float().abs().amax(-1, keepdim=True) / 127).double()
    xq = torch.round(x.float() / torch.where(sx > 0, sx, torch.ones_like(sx)).float()).clamp(-127, 127).double()
    ref = (xq @ q.double().t()) * sx * s.double() + bias.to(dtype).double()
    out = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[dtype]
    assert ((y.double() - ref).abs() <= 4 * 2.0**-24 * ref.abs() + out * ref.abs() + 1e-6).all()
    wd = q.double() * s.double()[:, None]
    exact = xf @ wd.t() + bias.to(dtype).double()
    act_err = (sx / 2) @ wd.abs().sum(-1, keepdim=True).t()  # half a step of each row's scale, per weight
    assert ((y.double() - exact).abs() <= act_err + out * exact.abs() + 1e-5).all()
    assert torch.equal(y[3], bias.to(dtype))
    for i in (0, 5, 69):  # a row's result does not depend on the rest of the step
        assert torch.equal(int8_gemm_linear(x[i : i + 1], q, s, bias.to(dtype)), y[i : i + 1])


def test_int8_activations_on_the_demo_model(demo_float32, capsys):
    """Many-row steps (the 16 prompts prefill together: more than the kernel's rows) go through the int8 GEMM
    and the per-layer paths that would widen the weights step aside for it; measured drift against float32."""
    llm = build_llm([*INT8, "pipeline.stages.decode.params.layer_ops_params={activations: int8}"])
    ops = llm.engine.rt.model.ops
    calls = []
    real = torch._int_mm

    def spy(a, b):
        calls.append(a.shape[0])
        return real(a, b)

    torch._int_mm = spy
    try:
        got = _run(llm)
    finally:
        torch._int_mm = real
    assert ops.int8_gemm and calls and min(calls) > INT8_KERNEL_MAX_ROWS
    same, drift = _compare(demo_float32, got)
    with capsys.disabled():
        print(f"\ncpu_int8 int8 activations demo model: {same}/{len(PROMPTS)} prompts with float32's greedy tokens, "
              f"max logprob drift {drift:.4f}")
    assert same >= MIN_SAME_TOKENS["float32"] and drift <= MAX_LOGPROB_DRIFT["float32"]
