"""cpu_paged attention: the C++ kernel matches the sdpa reference on identical inputs (decode, prefill chunks,
GQA/MQA, sliding windows, float32/bfloat16/float16), a whole model generates the same greedy tokens with it, and a
kernel that cannot be built falls back to sdpa with a warning instead of failing."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from litellm_pipeline import LLM, SamplingParams, registry
from litellm_pipeline.model import attention_cpu
from litellm_pipeline.model.attention import sdpa_paged_attention
from litellm_pipeline.testing.attention import AttentionCase
from litellm_pipeline.testing.attention import make_step as random_step

BLOCK = 16
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="module")
def kernel():
    """The compiled op (built once per session; a broken build fails here, naming the compiler error)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    op = attention_cpu.kernel()
    assert op is not None, attention_cpu._error
    return op


def make_step(decode_ctx, prefills, hq, hk, d, dtype, block=BLOCK, seed=0):
    """Random caches + one step (the conformance kit's): ``prefills`` [(q_len, ctx_len)], ``decode_ctx`` the decode
    contexts; slots scattered over a shared pool as the real pool's, decode tables padded with another sequence's
    slot 0."""
    case = AttentionCase("step", tuple(decode_ctx), tuple(map(tuple, prefills)), (hq, hk), d, block)
    return random_step(case, dtype, "cpu", seed)


def run_both(step, window, scale=None):
    q, k, v, k_cache, v_cache, meta = step
    scale = scale or q.shape[-1] ** -0.5
    kc1, vc1, kc2, vc2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ref = sdpa_paged_attention(q, k, v, kc1, vc1, meta, scale, window)
    out = attention_cpu.cpu_paged_attention(q, k, v, kc2, vc2, meta, scale, window)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)  # both wrote the new K/V into the same slots
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("d", [128, 64, 32])  # 64 and 128: the 16-bit vector path
def test_decode_matches_sdpa(kernel, dtype, window, heads, d):
    step = make_step([1, 5, 17, 40, 33, 100], [], *heads, d, dtype, seed=d + heads[0])
    out, ref = run_both(step, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("d", [80, 13])
def test_odd_head_dims(kernel, d):
    step = make_step([3, 70, 129], [(4, 30)], 6, 3, d, torch.float32)
    out, ref = run_both(step, None)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_large_scores_stay_stable(kernel):
    """Scores in the hundreds, rising across chunks: the online softmax rescales instead of overflowing."""
    q, k, v, k_cache, v_cache, meta = make_step([150, 300, 77], [], 4, 2, 64, torch.float32, seed=11)
    ramp = torch.linspace(0.1, 3.0, k_cache.shape[0])[:, None, None]  # later slots get larger keys
    k_cache.mul_(ramp * 20)
    out, ref = run_both((q * 10, k, v, k_cache, v_cache, meta), None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 9], ids=["full", "window9"])
def test_prefill_and_decode_mixed(kernel, dtype, window):
    # fresh prompts (kernel; the longest through SDPA), chunks over a cached prefix (short: kernel, long: SDPA)
    prefills = [(12, 12), (5, 40), (30, 50), (1, 20), (attention_cpu.PREFILL_KERNEL_MAX_FRESH + 3,) * 2]
    step = make_step([2, 64, 31], prefills, 8, 2, 64, dtype, seed=3)
    out, ref = run_both(step, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_kernel_prefill_any_length(kernel, monkeypatch, window):
    """With the SDPA hand-off disabled, the kernel's causal offset is right for every chunk shape."""
    monkeypatch.setattr(attention_cpu, "PREFILL_KERNEL_MAX_Q", 10**9)
    monkeypatch.setattr(attention_cpu, "PREFILL_KERNEL_MAX_FRESH", 10**9)
    step = make_step([9], [(12, 12), (5, 40), (30, 50), (17, 17)], 4, 2, 32, torch.float32, seed=5)
    out, ref = run_both(step, window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def _narrow_caches(step, kv):
    q, k, v, k_cache, v_cache, meta = step
    return q, k, v, k_cache.to(kv), v_cache.to(kv), meta


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("d", [64, 32])  # 64: the 16-bit vector path
def test_16bit_cache_under_float32_queries_matches_sdpa(kernel, kv, window, d):
    """cache.dtype float16 / bfloat16 under a float32 model: both write the new K/V rounded to the cache's dtype
    and attend in float32 over the rounded values (decode rows and prefill chunks on the kernel and on SDPA)."""
    step = make_step([2, 64, 31, 100], [(12, 12), (5, 40), (30, 50)], 8, 2, d, torch.float32, seed=d)
    q, k, v, k_cache, v_cache, meta = _narrow_caches(step, kv)
    kc1, vc1, kc2, vc2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    scale = d ** -0.5
    ref = sdpa_paged_attention(q, k, v, kc1, vc1, meta, scale, window)
    out = attention_cpu.cpu_paged_attention(q, k, v, kc2, vc2, meta, scale, window)
    assert out.dtype == torch.float32 and kc2.dtype == kv
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert torch.equal(kc2[meta.slot_mapping], k.to(kv)) and torch.equal(vc2[meta.slot_mapping], v.to(kv))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    # float32 caches holding the rounded values give the same result; the unrounded ones another
    rounded = attention_cpu.cpu_paged_attention(q, k.to(kv).float(), v.to(kv).float(), kc2.float(), vc2.float(),
                                                meta, scale, window)
    torch.testing.assert_close(rounded, out, **TOL[torch.float32])
    exact = attention_cpu.cpu_paged_attention(*step[:3], step[3].clone(), step[4].clone(), meta, scale, window)
    assert (exact - out).abs().max() > 1e-4


def test_a_cache_the_kernel_does_not_read_is_refused_by_name(kernel):
    """The op takes the queries' dtype or a 16-bit cache under float32 queries; anything else names both."""
    q, k, v, k_cache, v_cache, meta = make_step([4, 9], [], 4, 2, 32, torch.bfloat16)
    out = torch.empty_like(q)
    rows, slots, lens = meta.decode_rows, meta.decode_kv_slots.contiguous(), meta.decode_ctx_lens
    with pytest.raises(RuntimeError, match="Half cache with BFloat16 queries is not supported"):
        kernel(out, q, k_cache.half(), v_cache.half(), rows, slots, lens, 1, 0.1, 0)
    with pytest.raises(RuntimeError, match="Float cache with BFloat16 queries is not supported"):
        kernel(out, q, k_cache.float(), v_cache.float(), rows, slots, lens, 1, 0.1, 0)
    assert not attention_cpu.kv_cache_supported(torch.bfloat16, torch.float16)
    assert attention_cpu.kv_cache_supported(torch.float32, torch.bfloat16)


def test_bad_slot_raises_instead_of_reading_out_of_bounds(kernel):
    q, k, v, k_cache, v_cache, meta = make_step([10, 20], [], 4, 2, 32, torch.float32)
    meta.decode_kv_slots[1, 3] = k_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="out of range"):
        attention_cpu.cpu_paged_attention(q, k, v, k_cache, v_cache, meta, 0.1, None)


@pytest.fixture
def fresh_loader(monkeypatch):
    """A loader that has not tried to build yet (restored afterwards, so the cached kernel stays for others)."""
    monkeypatch.setattr(attention_cpu, "_op", None)
    monkeypatch.setattr(attention_cpu, "_error", None)
    monkeypatch.setattr(attention_cpu, "_warned", set())


def test_failed_build_falls_back_to_sdpa_with_one_warning(fresh_loader, monkeypatch):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("Error building extension 'x': c++: not found")

    monkeypatch.setattr(attention_cpu, "_build_kernel", broken)
    step = make_step([4, 25], [(6, 20)], 4, 2, 32, torch.float32)
    with pytest.warns(RuntimeWarning, match="falls back to sdpa.*c\\+\\+: not found"):
        out, ref = run_both(step, None)
    assert torch.equal(out, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call neither rebuilds nor warns again
        out, ref = run_both(step, 5)
    assert torch.equal(out, ref) and len(calls) == 1


def test_unsupported_dtype_falls_back(kernel, monkeypatch):
    monkeypatch.setattr(attention_cpu, "_warned", set())
    step = make_step([4, 25], [], 4, 2, 32, torch.float64)
    with pytest.warns(RuntimeWarning, match="float64"):
        out, ref = run_both(step, None)
    assert torch.equal(out, ref)


def test_registered():
    assert registry.get("attention", "cpu_paged") is attention_cpu.cpu_paged_attention


def test_end_to_end_greedy_equals_default(kernel, hf_checkpoint, monkeypatch):
    """Mistral (GQA, sliding window 8): same greedy tokens as sdpa, also when prompts reuse cached prefixes."""
    path = str(hf_checkpoint("mistral"))
    calls = []

    def counted(*args):
        calls.append(args[7])  # q_len: 1 for the decode group, > 1 for prefill chunks run by the kernel
        return kernel(*args)

    monkeypatch.setattr(attention_cpu, "_op", counted)
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 40)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    configs = (
        ("sdpa", ["pipeline.stages.decode.params.attention=sdpa"]),
        # torch layer ops: every attention call goes through the Python entry point, where it is counted
        ("cpu_paged", ["pipeline.stages.decode.params.attention=cpu_paged", "pipeline.stages.decode.params.layer_ops=torch"]),
        ("default", []),  # cpu_paged inside the fused decode block of cpu_fused layer ops
    )
    for name, overrides in configs:
        llm = LLM(model=path, overrides=overrides)
        first = [o.token_ids for o in llm.generate(prompts, params)]
        again = [o.token_ids for o in llm.generate(prompts[::-1], params)][::-1]  # prefix-cache hits
        outs[name] = (first, again)
    assert outs["cpu_paged"] == outs["sdpa"] == outs["default"]
    assert 1 in calls  # the kernel really ran (no silent fallback)
    assert outs["sdpa"][0] == outs["sdpa"][1]


def test_the_gather_workspace_serves_inside_and_outside_inference_mode():
    """A gather buffer first made during an engine step (inference mode) must not be written by a later call outside
    it (a conformance check, a test): torch refuses in-place writes to inference tensors there."""
    from litellm_pipeline.model.attention import gather_slots

    cache = torch.randn(40, 3, 7)
    slots = torch.tensor([5, 1, 30])
    with torch.inference_mode():
        inside = gather_slots(cache, slots, "regression").clone()
    outside = gather_slots(cache, slots, "regression")
    assert torch.equal(inside, cache[slots]) and torch.equal(outside, cache[slots])
