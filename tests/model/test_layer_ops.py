"""layer_ops: the cpu_fused C++ ops equal the torch reference (bit for bit in bf16/fp16, to rounding in fp32),
the small-M linear equals a float64 GEMM over every tile shape it has (row tails, K tails, bias), inputs it
does not cover go to torch unchanged, a kernel that cannot build degrades to torch with a warning, and whole
models generate transformers' tokens with the reference ops too."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from hf_models import hf_generate, random_prompts

from litellm_pipeline import LLM, SamplingParams, registry
from litellm_pipeline.model import cpu_kernels, layer_ops
from litellm_pipeline.model.layer_ops import CpuFusedLayerOps, TorchLayerOps

HALF = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *HALF)


@pytest.fixture(scope="module")
def fused():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    ops = CpuFusedLayerOps()
    assert ops._ok, "C++ kernels did not build"
    return ops


@pytest.fixture(scope="module")
def team(fused):
    """The decode team (every layer in one parallel region): part of every vector build (AVX2, AVX-512), not
    of a generic one (LITELLM_PIPELINE_CPU_ISA=generic, or a CPU without AVX2)."""
    if not cpu_kernels.ops().small_linear_supported():
        pytest.skip(f"this kernel build has no vector kernels (simd_isa {cpu_kernels.ops().simd_isa()}): no team")
    return fused


REF = TorchLayerOps()


def _same(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    if dtype in HALF:
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    else:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_ops_match_reference(fused, dtype):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, w = rnd(7, 3, 64, scale=3.0), rnd(64)
    _same(fused.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), dtype)
    strided = rnd(5, 200)[:, :96]  # rows that are not contiguous with each other
    w96 = rnd(96)
    _same(fused.rms_norm(strided, w96, 1e-5), REF.rms_norm(strided, w96, 1e-5), dtype)
    h, r = rnd(5, 96), rnd(5, 96)
    (s1, n1), (s2, n2) = fused.add_rms_norm(h, r, w96, 1e-5), REF.add_rms_norm(h, r, w96, 1e-5)
    assert torch.equal(s1, s2)
    _same(n1, n2, dtype)
    gu = rnd(6, 2 * 50, scale=4.0)  # large |x| too: the exp must neither overflow nor flush wrongly
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    _same(fused.silu_mul(gu), REF.silu_mul(gu), dtype)
    # RoPE on views of one fused qkv row block, as the attention layer hands them over
    qkv = rnd(9, (4 + 2 * 2) * 16)
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.reshape(9, 4, 16), k.reshape(9, 2, 16)
    half_c, half_s = torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g)
    cos, sin = torch.cat((half_c, half_c), -1).to(dtype), torch.cat((half_s, half_s), -1).to(dtype)
    q_ref, k_ref = REF.rotary(q.clone(), k.clone(), cos, sin)
    q_out, k_out = fused.rotary(q, k, cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)  # no rounding differences even in fp32


def test_float16_conversions_are_exact_on_every_value(fused):
    """The kernels' own float16 <-> float32 conversions (vectorisable, cpu_math.h): ``add_rms_norm``'s sum
    ``x + 0`` rounds every one of the 65536 float16 values (subnormals, infinities, both zeros) through them and
    must give torch's bits; NaN stays NaN. Then values between float16 neighbours must round to nearest even."""
    ns = cpu_kernels.ops()
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(256, 256)
    zero = torch.zeros_like(x)
    s, _ = ns.add_rms_norm(x, zero, torch.ones(256, dtype=torch.float16), 1e-6)
    ref = (x.float() + zero.float()).half()
    nan = ref.isnan()
    assert torch.equal(s.isnan(), nan)
    assert torch.equal(s.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
    # float32 sums that fall between float16 values (ties included) and past its range
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 256, generator=g) * torch.logspace(-9, 5, 256)).float()
    b = torch.randn(64, 256, generator=g) * 1e-3
    a[0, :4] = torch.tensor([65504.0, 65520.0, 1e6, -1e6])  # largest, the overflow tie, past the range
    b[0, :4] = 0
    a16, b16 = a.half(), b.half()
    s, _ = ns.add_rms_norm(a16, b16, torch.ones(256, dtype=torch.float16), 1e-6)
    assert torch.equal(s.view(torch.int16), (a16.float() + b16.float()).half().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("out_f,in_f", [(37, 45), (2304, 768), (96, 16), (8, 200)])
def test_small_linear_equals_float64_gemm(fused, dtype, rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    saved = dict(fused.max_rows)
    fused.max_rows[dtype] = 32  # exercise the kernel at every row count here
    try:
        for bias in (None, b):
            out = fused.linear(x, w, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert out.dtype == dtype and out.shape == (rows, out_f)
            # fp32: accumulation order only; bf16 / fp16: one final rounding (2^-8 / 2^-11 relative)
            tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
            err = ((out.double() - ref).abs() / (ref.abs() + in_f**0.5)).max().item()
            assert err < tol, err
    finally:
        fused.max_rows.clear()
        fused.max_rows.update(saved)


def test_linear_outside_the_kernel_is_torch(fused):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g)
    many = torch.randn(layer_ops.SMALL_LINEAR_MAX_ROWS[torch.float32] + 1, 48, generator=g)
    assert torch.equal(fused.linear(many, w), F.linear(many, w))
    x64, w64 = torch.randn(2, 48, dtype=torch.float64, generator=g), w.double()
    assert torch.equal(fused.linear(x64, w64), F.linear(x64, w64))
    noncontig = torch.randn(48, 2, generator=g).t()
    assert torch.equal(fused.linear(noncontig, w), F.linear(noncontig, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_linear_past_the_kernel_follows_the_cpu(fused, dtype):
    """Many rows: torch's 16-bit GEMM where the CPU has native 16-bit products, else the float32 GEMM on
    widened operands rounded once (upconvert_linear)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 48, generator=g).to(dtype)
    many = torch.randn(fused.max_rows[dtype] + 1, 48, generator=g).to(dtype)
    want = layer_ops.upconvert_linear(many, w) if dtype in fused._upconvert else F.linear(many, w)
    assert torch.equal(fused.linear(many, w), want)
    exact = F.linear(many.double(), w.double()).to(dtype)  # widening is exact: one rounding of float32 sums
    assert (layer_ops.upconvert_linear(many, w).double() - exact.double()).abs().max() <= exact.double().abs().max() * 2**-7
    ns = cpu_kernels.ops()
    native = ns.native_bf16_gemm() if dtype == torch.bfloat16 else ns.native_fp16_gemm()
    assert (dtype in fused._upconvert) == (not native)


def test_kernel_errors_name_the_problem(fused):
    op = cpu_kernels.ops()
    if op.small_linear_supported():
        with pytest.raises(RuntimeError, match="x and w must share a dtype"):
            op.small_linear(torch.randn(1, 8), torch.randn(4, 8).double(), None)
        with pytest.raises(RuntimeError, match="bias must be a contiguous"):
            op.small_linear(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5))
    else:  # a CPU without AVX-512: the kernel says so, and cpu_fused's linear never calls it
        with pytest.raises(RuntimeError, match="has no AVX-512 or AVX2 kernel"):
            op.small_linear(torch.randn(1, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="weight must be"):
        op.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="last dim must be even"):
        op.silu_mul(torch.randn(2, 7))


def test_unbuildable_kernels_fall_back_to_torch_with_a_warning(monkeypatch):
    def broken():
        raise RuntimeError("Error building extension 'x': c++: not found")

    monkeypatch.setattr(cpu_kernels, "ops", broken)
    with pytest.warns(RuntimeWarning, match="cpu_fused runs the torch ops.*c\\+\\+: not found"):
        ops = CpuFusedLayerOps()
    x, w = torch.randn(3, 16), torch.randn(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(ops.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
        w4 = torch.randn(4, 16)
        assert torch.equal(ops.linear(x, w4), F.linear(x, w4))


def test_registered():
    assert registry.get("layer_ops", "torch") is TorchLayerOps
    assert registry.get("layer_ops", "cpu_fused") is CpuFusedLayerOps
    with pytest.raises(registry.RegistryError, match="cpu_fused"):
        registry.get("layer_ops", "nope")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_reference_ops_keep_transformers_parity(arch, hf_checkpoint):
    """The torch reference ops (selected by config) give transformers' tokens: qkv bias, qk-norm, MoE experts."""
    path = hf_checkpoint(arch)
    prompts = random_prompts((5, 13), seed=11)
    llm = LLM(model=str(path), overrides=["pipeline.stages.decode.params.layer_ops=torch"])
    assert isinstance(llm.engine.rt.model.layers[0].self_attn.ops, TorchLayerOps)
    assert not isinstance(llm.engine.rt.model.layers[0].self_attn.ops, CpuFusedLayerOps)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[0] for r in hf_generate(path, prompts, 12)]


def test_fused_ops_are_bound_to_every_layer(hf_checkpoint):
    llm = LLM(model=str(hf_checkpoint("qwen3_moe")))
    model = llm.engine.rt.model
    bound = {type(m.ops) for m in model.modules() if hasattr(m, "ops")}
    assert bound == {CpuFusedLayerOps}


@pytest.mark.parametrize("arch", ["llama", "llama+bias", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fused_decode_equals_op_by_op(arch, dtype, hf_checkpoint, fused):
    """All layers in one call, each layer's attention half + dense MLP in one call, and the ops one by one give
    bit-identical logprobs: qkv bias (qwen2), q/k/v and o bias (llama+bias: attention_bias), q/k norm (qwen3),
    sliding window (mistral), MoE (qwen3_moe), and a shared expert (qwen2_moe: no whole-model call, per-layer
    blocks only)."""
    path = hf_checkpoint("llama", attention_bias=True) if arch == "llama+bias" else hf_checkpoint(arch)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for mode in ("model", "layer", "ops"):
        llm = LLM(model=str(path), dtype=dtype)
        model = llm.engine.rt.model
        # no more rows than this CPU's kernels take for the dtype, so the whole-model call runs on every CPU
        prompts = random_prompts((5, 13, 21)[: model.ops.max_rows[getattr(torch, dtype)]], seed=12)
        assert all(layer.fused_decode is not None for layer in model.layers)
        assert (model.fused_decode_layers is None) == (arch == "qwen2_moe")
        if mode != "model":
            model.fused_decode_layers = None
        if mode == "ops":
            for layer in model.layers:
                layer.fused_decode = None
        team_before = torch.ops.litellm_pipeline_cpu.decode_team_runs()
        outs = llm.generate(prompts, params)
        team_ran = torch.ops.litellm_pipeline_cpu.decode_team_runs() > team_before
        # the whole-model call runs in one parallel region (qwen2_moe's shared expert has no whole-model call;
        # a build without vector kernels has no region and runs the call op by op)
        assert team_ran == (mode == "model" and arch != "qwen2_moe" and cpu_kernels.ops().small_linear_supported())
        runs[mode] = [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
        assert llm.engine.rt.pool.is_empty()
    assert runs["model"] == runs["layer"] == runs["ops"]


def test_whole_model_decode_takes_steps_that_mix_tiers(hf_checkpoint, team, monkeypatch):
    """Requests of different tiers in one step (per-token top-k, per-layer TierSets) stay on the one-call path;
    each gets the tokens it gets alone, and the same tokens as op by op."""
    llm = LLM(model=str(hf_checkpoint("qwen3_moe")), overrides=["+tiers.mix.experts_per_token=[1,4]"])
    engine, model = llm.engine, llm.engine.rt.model
    taken = []
    real, real_tokens = model.fused_decode_layers, model.decode_tokens  # both take the step's plan last
    monkeypatch.setattr(model, "fused_decode_layers",
                        lambda *a, **k: taken.append((a[-1], out := real(*a, **k))) or out)
    monkeypatch.setattr(model, "decode_tokens",
                        lambda *a, **k: taken.append((a[-1], out := real_tokens(*a, **k))) or out)
    prompts = random_prompts((6, 9, 4), seed=13)
    tiers = ("fast", "max", "mix")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    alone = [llm.generate([p], params, tier=t)[0] for p, t in zip(prompts, tiers)]
    taken.clear()
    reqs = [engine.add_request(p, params, tier=t) for p, t in zip(prompts, tiers)]
    while not all(r.finished for r in reqs):
        engine.step()
    assert [r.output_ids for r in reqs] == [o.token_ids for o in alone]
    mixed = [out for plan, out in taken if isinstance(plan, tuple) or (plan is not None and plan.top_k is not None)]
    assert mixed and all(out is not None for out in mixed)  # offered and run in one call
    monkeypatch.setattr(model, "fused_decode_layers", None)  # op by op: the same tokens and logprobs
    by_ops = [engine.add_request(p, params, tier=t) for p, t in zip(prompts, tiers)]
    while not all(r.finished for r in by_ops):
        engine.step()
    assert [(r.output_ids, r.logprobs) for r in by_ops] == [(r.output_ids, r.logprobs) for r in reqs]
    assert engine.rt.pool.is_empty()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_fused_route_with_tierset_limits_equals_the_reference(fused, dtype):
    from litellm_pipeline.model.moe import route_tokens
    from litellm_pipeline.registry.types import RoutePlan

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 32, generator=g).to(dtype)
    gate = torch.randn(8, 32, generator=g).to(dtype)
    top_k = torch.randint(1, 5, (40,), generator=g)
    allowed = torch.rand(40, 8, generator=g) > 0.3
    allowed[:, 0] = True
    for plan in (None, RoutePlan(max_k=3), RoutePlan(top_k=top_k, max_k=4),
                 RoutePlan(top_k=top_k, max_k=4, allowed=allowed), RoutePlan(max_k=8, allowed=allowed)):
        for normalize in (True, False):
            idx, w = fused.route(x, gate, 2, normalize, plan)
            ref_idx, ref_w = route_tokens(F.linear(x, gate), 2, normalize, plan)
            assert torch.equal(idx, ref_idx)
            torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)


def test_fused_decode_only_with_the_paged_kernel_and_fused_dispatch(hf_checkpoint):
    llm = LLM(model=str(hf_checkpoint("llama")), overrides=["pipeline.stages.decode.params.attention=sdpa"])
    assert all(layer.fused_decode is None for layer in llm.engine.rt.model.layers)
    assert llm.engine.rt.model.fused_decode_layers is None
    moe = LLM(model=str(hf_checkpoint("mixtral")), overrides=["pipeline.stages.decode.params.moe_dispatch=packed"])
    assert moe.engine.rt.model.fused_decode_layers is None  # packed experts: layer by layer
    assert all(layer.fused_decode is not None for layer in moe.engine.rt.model.layers)


def _decode_step(dtype, rows, hq, hk, *, int8=False, bias=False, qk_norm=False, window=0, layers=2, seed=0,
                 experts=0, limits=False, kv=None):
    """Random layers (dense, or MoE blocks of ``experts`` experts routing 2 per token; ``limits``: per-token
    top-k and allowed experts as TierSets give them), a paged cache with some context per sequence (of dtype
    ``kv``, default ``dtype``: cache.dtype), and decode_layers' arguments."""
    from litellm_pipeline.model.int8_ops import quantize_rows

    g = torch.Generator().manual_seed(seed)
    H, D, inter, slots_n = 40, 16, 52, 96  # H and the intermediate size are not multiples of 8: kernel tails

    def rnd(*shape, s=0.3):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    def weight(o, k, stack=False):
        w = torch.randn(*((experts,) if stack else ()), o, k, generator=g) * 0.2
        return quantize_rows(w) if int8 else (w.to(dtype), None)

    qkv_o = (hq + 2 * hk) * D
    per = {k: [] for k in ("in_norm", "qkv_w", "qkv_s", "qkv_b", "q_norm", "k_norm", "o_w", "o_s", "post", "a", "a_s",
                           "b", "b_s", "kc", "vc", "router")}
    for _ in range(layers):
        for key, (o, k) in (("qkv", (qkv_o, H)), ("o", (H, hq * D)), ("a", (2 * inter, H)), ("b", (H, inter))):
            w, s = weight(o, k, stack=experts > 0 and key in ("a", "b"))
            per[key if key in ("a", "b") else f"{key}_w"].append(w)
            if s is not None:
                per[f"{key}_s"].append(s)
        per["in_norm"].append(1 + rnd(H, s=0.1))
        per["post"].append(1 + rnd(H, s=0.1))
        if bias:
            per["qkv_b"].append(rnd(qkv_o, s=0.1))
        if qk_norm:
            per["q_norm"].append(1 + rnd(D, s=0.1))
            per["k_norm"].append(1 + rnd(D, s=0.1))
        per["kc"].append(rnd(slots_n, hk, D, s=1.0).to(kv or dtype))
        per["vc"].append(rnd(slots_n, hk, D, s=1.0).to(kv or dtype))
        if experts:
            per["router"].append(rnd(experts, H, s=1.0))
    ctx = [5 + 9 * i for i in range(rows)]
    perm = torch.randperm(slots_n, generator=g)  # scattered slots, none shared between sequences
    kv_slots = torch.zeros(rows, max(ctx), dtype=torch.long)
    start = 0
    for i, n in enumerate(ctx):
        kv_slots[i, :n] = perm[start : start + n]
        start += n
    lens = torch.tensor(ctx)
    pos = lens - 1
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    top_k, allowed = [], []
    if experts and limits:  # token 0 may use 1 expert, the others 2; each token a random half of the experts
        top_k = [torch.tensor([1] + [2] * (rows - 1)) for _ in range(layers)]
        allowed = [torch.rand(rows, experts, generator=g) > 0.5 for _ in range(layers)]
        for a in allowed:
            a[:, 0] = True
    args = [rnd(rows, H, s=1.0), per["in_norm"], per["qkv_w"], per["qkv_b"], per["q_norm"], per["k_norm"], cos, sin,
            per["kc"], per["vc"], kv_slots[torch.arange(rows), pos], torch.arange(rows), kv_slots, lens, per["o_w"], [],
            per["post"], per["a"], per["b"], per["router"], [window] * layers, 1e-6, 1e-6, D ** -0.5, hq, hk, D,
            [2] * layers if experts else [], top_k, allowed, True, 32, per["qkv_s"], per["o_s"], per["a_s"],
            per["b_s"]]
    return args


def _run_decode_layers(args, team):
    args = [[t.clone() for t in a] if i in (8, 9) else a for i, a in enumerate(args)]  # fresh caches per run
    out = torch.ops.litellm_pipeline_cpu.decode_layers(*args, team)
    return out, args[8], args[9]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "case",
    [dict(dtype=torch.float32, rows=1, hq=4, hk=2), dict(dtype=torch.float32, rows=3, hq=4, hk=1, bias=True),
     dict(dtype=torch.bfloat16, rows=2, hq=6, hk=3, qk_norm=True), dict(dtype=torch.float16, rows=1, hq=4, hk=4, window=6),
     dict(dtype=torch.bfloat16, rows=3, hq=4, hk=2, int8=True), dict(dtype=torch.float32, rows=1, hq=2, hk=2, int8=True),
     dict(dtype=torch.float32, rows=1, hq=4, hk=2, experts=4), dict(dtype=torch.bfloat16, rows=3, hq=4, hk=2, experts=5),
     dict(dtype=torch.float16, rows=4, hq=4, hk=1, experts=4, limits=True),
     dict(dtype=torch.float32, rows=3, hq=4, hk=2, experts=4, int8=True, limits=True),
     dict(dtype=torch.float32, rows=3, hq=4, hk=2, kv=torch.float16),
     dict(dtype=torch.float32, rows=2, hq=4, hk=1, experts=4, window=6, kv=torch.bfloat16)],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()).replace("torch.", ""),
)
def test_decode_layers_in_one_parallel_region_is_bit_identical(team, case, threads):
    """The one-region decode (each thread its share of every projection and of the kv heads, spin barriers
    between) gives the op-by-op calls' hidden states and K/V caches bit for bit, for 1-3 threads, fewer kv heads
    than threads, bias, q/k norm, a sliding window, int8 weights, MoE blocks with and without TierSet limits, and
    float16 / bfloat16 caches under float32 activations (the K/V rounded as index_copy_ of ``k.to(cache)`` does)."""
    args = _decode_step(**case)
    before, runs = torch.get_num_threads(), torch.ops.litellm_pipeline_cpu.decode_team_runs()
    try:
        torch.set_num_threads(threads)
        team = _run_decode_layers(args, True)
        assert torch.ops.litellm_pipeline_cpu.decode_team_runs() == runs + 1  # the region ran, no fallback
        ops = _run_decode_layers(args, False)
        assert torch.ops.litellm_pipeline_cpu.decode_team_runs() == runs + 1
    finally:
        torch.set_num_threads(before)
    assert torch.equal(team[0], ops[0])
    for a, b in zip(team[1] + team[2], ops[1] + ops[2]):
        assert torch.equal(a, b)
    assert not torch.equal(team[1][0], args[8][0])  # the step wrote its K rows


def _plan_of(args, final_norm=None, head=None, head_s=None):
    """A DecodePlan of _decode_step's per-model arguments (the layers, caches and shapes)."""
    a = args
    return torch.classes.litellm_pipeline_cpu.DecodePlan(
        a[1], a[2], a[3], a[4], a[5], a[8], a[9], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22],
        a[23], a[24], a[25], a[26], a[27][0] if a[27] else 0, a[30], a[31], a[32], a[33], a[34], a[35], final_norm,
        1e-5, head, head_s, False)


def _plan_run(plan, args, logits):
    a = args
    return plan.run(a[0], a[6], a[7], a[10], a[11], a[12], a[13], a[27], a[28], a[29], logits)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "case",
    [dict(dtype=torch.float32, rows=1, hq=4, hk=2), dict(dtype=torch.bfloat16, rows=3, hq=4, hk=2, experts=5),
     dict(dtype=torch.float16, rows=2, hq=4, hk=4, window=6), dict(dtype=torch.float32, rows=3, hq=4, hk=2, int8=True,
                                                                   experts=4, limits=True)],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()).replace("torch.", ""),
)
def test_decode_plan_runs_the_lm_head_in_the_region_as_compute_logits_does(team, case, threads):
    """A kept DecodePlan with the final norm and LM head gives, in one region, the float32 logits that the
    op-by-op layers, rms_norm, the linear in the activation dtype and .float() give, bit for bit (an int8 head
    with its scales through the int8 kernel); without `logits` it gives the hidden states."""
    from litellm_pipeline.model.int8_ops import quantize_rows

    dtype = case["dtype"]
    args = _decode_step(**case)
    g = torch.Generator().manual_seed(5)
    V, H = 37, args[0].shape[1]  # a vocabulary that is not a multiple of the kernels' row blocks
    norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    w = torch.randn(V, H, generator=g) * 0.2
    head, head_s = quantize_rows(w) if case.get("int8") else (w.to(dtype), None)
    before, runs = torch.get_num_threads(), torch.ops.litellm_pipeline_cpu.decode_team_runs()
    try:
        torch.set_num_threads(threads)
        fresh = [[t.clone() for t in a] if i in (8, 9) else a for i, a in enumerate(args)]
        plan = _plan_of(fresh, norm, head, head_s)
        assert plan.has_head() and plan.reason() == plan.head_reason() == ""
        logits = _plan_run(plan, fresh, True)
        hidden_again = _plan_run(plan, fresh, False)  # the same step again: the same K/V rows rewritten
        assert torch.ops.litellm_pipeline_cpu.decode_team_runs() == runs + 2
        ref_h = _run_decode_layers(args, False)[0]
    finally:
        torch.set_num_threads(before)
    x = team.rms_norm(ref_h, norm, 1e-5)
    if head_s is None:
        ref = torch.ops.litellm_pipeline_cpu.small_linear(x, head, None).float()
    else:
        ref = torch.ops.litellm_pipeline_cpu.int8_linear(x, head, head_s, None).float()
    assert logits.dtype == torch.float32 and logits.shape == (args[0].shape[0], V)
    assert torch.equal(logits, ref)
    assert torch.equal(hidden_again, ref_h)


def test_decode_plan_says_why_it_cannot_run_a_model(team):
    """A plan over weights the region cannot read (a transposed view) names the weight and declines every step
    (None); a step with more rows than the kernels take is declined too, and the decode_layers op then runs it op
    by op, with the result of the op-by-op call."""
    args = _decode_step(torch.float32, 3, 4, 2)
    bad = list(args)
    bad[2] = [w.t().contiguous().t() for w in args[2]]  # the same values, not contiguous
    plan = _plan_of(bad)
    assert plan.reason() == "qkv: not contiguous" and not plan.has_head()
    assert _plan_run(plan, bad, False) is None
    head = torch.randn(16, args[0].shape[1]).to(torch.bfloat16)  # a head in another dtype: the layers only
    fresh = [[t.clone() for t in a] if i in (8, 9) else a for i, a in enumerate(args)]
    plan = _plan_of(fresh, torch.ones(args[0].shape[1]), head)
    assert plan.reason() == "" and not plan.has_head()
    assert plan.head_reason() == "lm_head: dtype differs from the activations"
    assert torch.equal(_plan_run(plan, fresh, True), _run_decode_layers(args, False)[0])  # hidden states
    few = list(args)
    few[31] = 2  # the kernels' row limit, below the step's 3 rows
    assert _plan_of(few).reason() == "" and _plan_run(_plan_of(few), few, False) is None
    runs = torch.ops.litellm_pipeline_cpu.decode_team_runs()
    out = _run_decode_layers(few, True)[0]
    assert torch.ops.litellm_pipeline_cpu.decode_team_runs() == runs  # declined: op by op
    assert torch.equal(out, _run_decode_layers(few, False)[0])


def test_decode_plan_declines_rows_that_are_not_one_per_sequence_in_order(team):
    """The region's attention items take row m as sequence m's query. A step whose rows are laid out otherwise
    (here sequences 0 and 1 swapped) is declined, and the decode_layers op runs it op by op with the result of
    the op-by-op call."""
    args = _decode_step(torch.float32, 3, 4, 2)
    swapped = list(args)
    order = torch.tensor([1, 0, 2])
    swapped[11] = order  # sequence s's query is row order[s]
    swapped[12], swapped[13] = args[12][order], args[13][order]  # each row keeps its slots and position
    assert _plan_run(_plan_of(swapped), swapped, False) is None
    runs = torch.ops.litellm_pipeline_cpu.decode_team_runs()
    out, kc, vc = _run_decode_layers(swapped, True)
    assert torch.ops.litellm_pipeline_cpu.decode_team_runs() == runs  # declined: op by op
    ref = _run_decode_layers(swapped, False)
    assert torch.equal(out, ref[0]) and all(torch.equal(a, b) for a, b in zip(kc + vc, ref[1] + ref[2]))
    assert _plan_run(_plan_of(args), args, False) is not None  # the same step in order runs in the region


def test_decode_steps_take_their_logits_from_the_region(hf_checkpoint, monkeypatch, team):
    """In an engine every decode-only step gets its logits (and greedy tokens) from the one-region call, straight
    from its tokens (compute_logits runs for prefill steps only), and the tokens and logprobs equal those of the
    metadata-then-layers-then-compute_logits path with the sampler's own argmax."""
    path = hf_checkpoint("llama")
    prompts = random_prompts((5, 11), seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(model=str(path))
    model = llm.engine.rt.model
    calls = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: calls.append(h.shape[0]) or real(h))
    runs = torch.ops.litellm_pipeline_cpu.decode_team_runs()
    outs = llm.generate(prompts, params)
    steps = torch.ops.litellm_pipeline_cpu.decode_team_runs() - runs
    assert steps >= params.max_tokens - 1 and model.decode_weights["plan"].has_head()
    assert len(calls) <= 2  # the prefill step(s); no decode step reached compute_logits
    real_layers = model.fused_decode_layers
    monkeypatch.setattr(model, "decode_tokens", lambda *a, **k: None)  # steps through forward's metadata
    monkeypatch.setattr(model, "fused_decode_layers",  # the layers' hidden states, then compute_logits
                        lambda *a, logits=False: model.compute_logits(real_layers(*a)) if logits else real_layers(*a))
    again = llm.generate(prompts, params)
    assert len(calls) > 2 + params.max_tokens // 2
    assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs) for o in again]
    assert llm.engine.rt.pool.is_empty()


def _tokens_step(args, seed=1):
    """_decode_step's step as run_tokens takes it: an embedding table and token ids whose rows are its input
    rows, rotary tables whose rows at ctx_lens - 1 are its cos / sin."""
    g = torch.Generator().manual_seed(seed)
    h, cos, sin, lens = args[0], args[6], args[7], args[13]
    rows, H = h.shape
    ids = torch.randperm(50, generator=g)[:rows]
    embed = (torch.randn(50, H, generator=g) * 0.5).to(h.dtype)
    embed[ids] = h
    P = int(lens.max()) + 3
    ct = torch.randn(P, cos.shape[1], generator=g).to(h.dtype)
    st = torch.randn(P, cos.shape[1], generator=g).to(h.dtype)
    ct[lens - 1], st[lens - 1] = cos, sin
    return ids, embed, ct, st


def _tokens_run(plan, args, tokens, logits, argmax):
    a = args
    return plan.run_tokens(*tokens, a[12], a[13], a[27], a[28], a[29], logits, argmax)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "case",
    [dict(dtype=torch.float32, rows=1, hq=4, hk=2), dict(dtype=torch.bfloat16, rows=3, hq=4, hk=2, experts=5),
     dict(dtype=torch.float16, rows=2, hq=4, hk=4, window=6, qk_norm=True),
     dict(dtype=torch.float32, rows=3, hq=4, hk=2, int8=True, experts=4, limits=True)],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()).replace("torch.", ""),
)
def test_decode_plan_runs_a_step_from_its_tokens_as_from_its_metadata(team, case, threads):
    """run_tokens (the plan embeds the ids, takes the rotary rows at ctx_lens - 1 and the new K/V slots from the
    slot table itself) gives run's logits and K/V caches bit for bit, and each row's argmax as argmax_rows and
    torch's max give it; a step it cannot take (past the rotary tables) is declined with []."""
    dtype = case["dtype"]
    args = _decode_step(**case)
    tokens = _tokens_step(args)
    g = torch.Generator().manual_seed(7)
    V, H = 37, args[0].shape[1]
    norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    head = (torch.randn(V, H, generator=g) * 0.2).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        a1 = [[t.clone() for t in a] if i in (8, 9) else a for i, a in enumerate(args)]
        a2 = [[t.clone() for t in a] if i in (8, 9) else a for i, a in enumerate(args)]
        ref = _plan_run(_plan_of(a1, norm, head), a1, True)
        plan = _plan_of(a2, norm, head)
        logits, idx = _tokens_run(plan, a2, tokens, True, True)
        hidden = _tokens_run(plan, a2, tokens, False, False)  # the same step again, hidden states only
        short = list(tokens)
        short[2], short[3] = tokens[2][:2], tokens[3][:2]  # tables shorter than the positions
        assert _tokens_run(plan, a2, short, True, True) == []
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits, ref)
    assert torch.equal(idx, torch.ops.litellm_pipeline_cpu.argmax_rows(ref)) and torch.equal(idx, ref.max(-1).indices)
    assert len(hidden) == 1 and hidden[0].shape == (args[0].shape[0], H)
    for x, y in zip(a1[8] + a1[9], a2[8] + a2[9]):
        assert torch.equal(x, y)
    assert not torch.equal(a2[8][0], args[8][0])  # the step wrote its K rows


@pytest.mark.parametrize("count", [0, 5, 8, 37, 1000, 4099])
@pytest.mark.parametrize("threads,shares", [(1, 1), (2, 2), (3, 3), (1, 2), (2, 4)])
def test_take_rows_runs_every_row_once(fused, count, threads, shares):
    """The team's rows of a projection: each row runs exactly once however the threads take them, also when
    fewer threads come than there are shares (their rows are taken by those that came), and a thread whose core
    stalls (`late`: it starts only after thread 0 has returned) finds its share run by the other."""
    trace = torch.ops.litellm_pipeline_cpu.take_rows_trace
    for late in (False, True):
        ran = trace(count, threads, shares, 32, late)
        assert ran.shape == (threads, count)
        assert torch.equal(ran.sum(0), torch.ones(count, dtype=torch.int32)), (late, ran.sum(0))
        if late and threads == 2:
            assert ran[1].sum() == 0 and ran[0].sum() == count  # thread 0 ran thread 1's share too
    with pytest.raises(RuntimeError, match="take_rows_trace: bad arguments"):
        trace(8, 2, 1, 32, False)  # fewer shares than threads


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_region_argmax_takes_the_first_maximum_across_thread_shares(team, threads):
    """The region's argmax combines the threads' vocabulary shares as torch's max does: ties go to the lowest id
    (here the tied rows sit in different threads' shares), and a NaN counts as the maximum (its first one)."""
    args = _decode_step(torch.float32, 3, 4, 2)
    tokens = _tokens_step(args)
    H, V = args[0].shape[1], 40
    e = torch.ones(H)
    head = torch.zeros(V, H)
    head[[3, 36]] = e  # equal logits, far apart: the largest where the normed rows sum above 0
    head[[5, 38]] = -e  # ... and these where they sum below
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for nan_rows in ([], [33, 20]):
            w = head.clone()
            w[nan_rows] = float("nan")
            fresh = [[t.clone() for t in a] if i in (8, 9) else a for i, a in enumerate(args)]
            logits, idx = _tokens_run(_plan_of(fresh, torch.ones(H), w), fresh, tokens, True, True)
            expect = logits.max(-1).indices
            assert torch.equal(idx, expect)
            assert set(idx.tolist()) <= ({20} if nan_rows else {3, 5})
    finally:
        torch.set_num_threads(before)


def test_run_tokens_names_a_bad_token_or_length_before_the_region(team):
    """run_tokens checks every row before any thread starts: a token id outside the embedding, a context length
    outside the slot table or a new slot outside the caches is an error naming the row and the value, and the
    caches are untouched; the plan then runs the good step."""
    args = _decode_step(torch.float32, 2, 4, 2)
    tokens = _tokens_step(args)
    plan = _plan_of(args)
    before = [t.clone() for t in args[8]]
    bad_ids = tokens[0].clone()
    bad_ids[1] = 50
    with pytest.raises(RuntimeError, match=r"token id 50 of row 1 out of range \[0, 50\)"):
        plan.run_tokens(bad_ids, *tokens[1:], args[12], args[13], [], [], [], False, False)
    with pytest.raises(RuntimeError, match=r"ctx_lens\[0\] = 0 outside \[1, "):
        plan.run_tokens(*tokens, args[12], torch.tensor([0, 5]), [], [], [], False, False)
    bad_slots = args[12].clone()
    bad_slots[0, int(args[13][0]) - 1] = 10_000
    with pytest.raises(RuntimeError, match=r"new K/V slot of row 0 = 10000 out of range"):
        plan.run_tokens(*tokens, bad_slots, args[13], [], [], [], False, False)
    assert all(torch.equal(a, b) for a, b in zip(args[8], before))
    assert len(plan.run_tokens(*tokens, args[12], args[13], [], [], [], False, False)) == 1


def test_decode_layers_errors_inside_the_region_end_it(team):
    """A check that fails on one thread inside the region (a context longer than its slot row, a kv slot out of
    range) ends the region with that error on every thread count, and the next step runs normally."""
    args = _decode_step(torch.float32, 2, 4, 2)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            bad = list(args)
            bad[13] = args[13] + torch.tensor([0, 100])  # ctx_lens past the slot table
            with pytest.raises(RuntimeError, match="ctx_len"):
                _run_decode_layers(bad, True)
            bad = list(args)
            bad[12] = args[12].clone()
            bad[12][1, 0] = 10_000
            with pytest.raises(RuntimeError, match="kv slot 10000 out of range"):
                _run_decode_layers(bad, True)
            bad = list(args)
            bad[10] = torch.tensor([0, 10_000])
            with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 10000 out of range"):
                _run_decode_layers(bad, True)
            assert torch.equal(_run_decode_layers(args, True)[0], _run_decode_layers(args, False)[0])
    finally:
        torch.set_num_threads(before)
