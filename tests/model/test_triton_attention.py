"""triton_paged attention: the Triton kernels against the sdpa reference on random paged steps (mixed prefill
chunks over cached prefixes and decodes, GQA/MQA/MHA, sliding windows, head dims 32/64, three dtypes), the
conformance kit, batch invariance, an engine run with the same greedy tokens as sdpa, the registry entry, and the
error for CPU tensors outside the interpreter.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
imported); with one, the same tests run them compiled on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from litellm_pipeline import SamplingParams, registry  # noqa: E402
from litellm_pipeline.model import triton_attention  # noqa: E402
from litellm_pipeline.model.attention import sdpa_paged_attention  # noqa: E402
from litellm_pipeline.model.triton_attention import triton_paged_attention  # noqa: E402
from litellm_pipeline.model.triton_common import interpreting  # noqa: E402
from litellm_pipeline.registry.types import AttentionMetadata, SeqAttention  # noqa: E402
from litellm_pipeline.testing import check_attention  # noqa: E402
from litellm_pipeline.testing._support import DEMO_PROMPTS, assert_drained, build_llm  # noqa: E402
from litellm_pipeline.testing.attention import AttentionCase  # noqa: E402
from litellm_pipeline.testing.attention import make_step as random_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("no CUDA device and TRITON_INTERPRET unset: the kernels cannot run", allow_module_level=True)

# vs sdpa (itself within the kit's float64 tolerances): both round their output to the dtype, and in the half
# types sdpa's math differs from the kernels' float32 online softmax (p rounded to the dtype before p @ V)
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = {"gqa": (8, 2), "mqa": (4, 1), "mha": (4, 4)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_step(decode_ctx, prefills, hq, hk, d, dtype, block=16, seed=0):
    """Random caches + one step (the conformance kit's): ``prefills`` [(q_len, ctx_len)], ``decode_ctx`` the decode
    contexts; slots scattered over a shared pool as the real pool's, decode tables padded with another sequence's
    slot 0."""
    case = AttentionCase("step", tuple(decode_ctx), tuple(map(tuple, prefills)), (hq, hk), d, block)
    return random_step(case, dtype, DEVICE, seed)


def run_both(step, window, scale=None):
    """(triton out, sdpa out) on copies of the same caches; both must leave identical caches behind."""
    q, k, v, k_cache, v_cache, meta = step
    scale = scale or q.shape[-1] ** -0.5
    kc1, vc1, kc2, vc2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ref = sdpa_paged_attention(q, k, v, kc1, vc1, meta, scale, window)
    out = triton_paged_attention(q, k, v, kc2, vc2, meta, scale, window)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), "the new K/V must land in exactly their slots"
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    return out, ref


# decode contexts from 1 token to several key blocks; fresh prompts and chunks over cached prefixes
MIXED_DECODE = (1, 5, 17, 40, 70, 130)
MIXED_PREFILLS = ((12, 12), (5, 40), (30, 50), (2, 90), (70, 70), (40, 100))


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_triton_mixed_step_matches_sdpa(dtype, heads, window):
    d = 64 if heads[1] != 1 else 32
    step = make_step(MIXED_DECODE, MIXED_PREFILLS, *heads, d, dtype, seed=heads[0] + (window or 0))
    out, ref = run_both(step, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("block", [1, 8])
def test_triton_head_dims_and_block_sizes(d, block):
    """Decode-only and prefill-only steps, slot-by-slot scattered (block 1) or in small blocks."""
    for decode, prefills in (((3, 64, 129), ()), ((), ((9, 9), (4, 33), (65, 65)))):
        step = make_step(decode, prefills, 6, 2, d, torch.float32, block=block, seed=d + block)
        out, ref = run_both(step, 5 if block == 1 else None)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_triton_wide_heads_use_smaller_tiles(window):
    """float32 head_dim 128: 32-key blocks and 8-query prefill tiles (x 4 heads), many blocks per sequence."""
    assert triton_attention._tile(4, 128) == 32
    step = make_step((1, 33, 100), ((9, 9), (20, 75)), 8, 2, 128, torch.float32, block=8, seed=13)
    out, ref = run_both(step, window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_triton_odd_head_dim_and_group():
    """head_dim 24 (padded to a 32-wide tile), 3 query heads per KV head (padded group), explicit scale."""
    step = make_step((3, 70), ((7, 7), (4, 13), (33, 60)), 6, 2, 24, torch.float32, block=4, seed=7)
    out, ref = run_both(step, None, scale=0.1)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_triton_large_scores_stay_stable():
    """Scores in the hundreds, rising across key blocks: the online softmax rescales instead of overflowing."""
    q, k, v, k_cache, v_cache, meta = make_step((150, 300, 77), ((20, 20), (10, 200)), 4, 2, 64,
                                                 torch.float32, seed=11)
    k_cache.mul_(torch.linspace(0.1, 3.0, k_cache.shape[0], device=DEVICE)[:, None, None] * 20)
    out, ref = run_both((q * 10, k, v, k_cache, v_cache, meta), None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_triton_window_of_one_sees_only_itself():
    """window 1: every token's output is its own V row (the edge of the window convention)."""
    q, k, v, k_cache, v_cache, meta = make_step((4, 66), ((5, 5), (3, 70)), 4, 2, 32, torch.float32, seed=3)
    out = triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.2, 1)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=1e-6)


def test_triton_rows_do_not_depend_on_the_batch():
    """A sequence's rows are bit for bit the same alone and in a batch with others (meta.batch_invariant)."""
    hq, hk, d = 8, 2, 32
    full = make_step((9, 70, 33), ((12, 12), (6, 80)), hq, hk, d, torch.float32, seed=5)
    q, k, v, k_cache, v_cache, meta = full
    out = triton_paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, d**-0.5, 16)

    # the chunk (6, 80) alone: its rows are 12..17 of the full batch
    s = meta.prefills[1]
    rows = slice(s.q_start, s.q_start + s.q_len)
    alone = AttentionMetadata(slot_mapping=meta.slot_mapping[rows], positions=meta.positions[rows],
                              prefills=[SeqAttention(0, s.q_len, s.ctx_len, s.kv_slots)])
    o1 = triton_paged_attention(q[rows], k[rows], v[rows], k_cache.clone(), v_cache.clone(), alone, d**-0.5, 16)
    assert torch.equal(o1, out[rows])

    # the decode of context 70 alone (its table row unpadded): row 19 of the full batch
    b, row = 1, int(meta.decode_rows[1])
    one = slice(row, row + 1)
    alone = AttentionMetadata(slot_mapping=meta.slot_mapping[one], positions=meta.positions[one], prefills=[],
                              decode_rows=torch.zeros(1, dtype=torch.long, device=DEVICE),
                              decode_kv_slots=meta.decode_kv_slots[b : b + 1, :70],
                              decode_ctx_lens=meta.decode_ctx_lens[b : b + 1])
    o2 = triton_paged_attention(q[one], k[one], v[one], k_cache.clone(), v_cache.clone(), alone, d**-0.5, 16)
    assert torch.equal(o2, out[one])


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="real sizes only compiled on a GPU (too slow for the interpreter)")
@pytest.mark.parametrize("window", [None, 1024], ids=["full", "window1024"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_real_sizes_on_cuda(dtype, window):
    """Llama-8B-like heads (32 query, 8 KV, head_dim 128), contexts in the thousands, long chunks over prefixes."""
    step = make_step((1, 300, 2047, 4000), ((512, 512), (256, 1800), (3, 900)), 32, 8, 128, dtype, seed=17)
    out, ref = run_both(step, window)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_triton_conformance_kit():
    # every case kind of the kit (fixed and random steps) in all three dtypes
    assert check_attention("triton_paged", device=DEVICE, random_steps=6) == 33


def test_triton_registry_lists_and_loads():
    assert "triton_paged" in registry.names("attention")
    assert registry.get("attention", "triton_paged") is triton_paged_attention
    assert str(registry.origin("attention", "triton_paged")) == "built-in"


def test_triton_cpu_tensors_without_interpreter_raise(monkeypatch):
    q, k, v, k_cache, v_cache, meta = make_step((4,), (), 4, 2, 32, torch.float32)
    if DEVICE != "cpu":
        q, k, v, k_cache, v_cache = (t.cpu() for t in (q, k, v, k_cache, v_cache))
    before = k_cache.clone()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"attention triton_paged: Triton kernels run on CUDA tensors.*"
                                           r"TRITON_INTERPRET=1.*cpu_paged"):
        triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.1, None)
    assert torch.equal(k_cache, before)  # refused before anything was written


def test_triton_engine_greedy_equals_sdpa(monkeypatch):
    """The demo model generates the same greedy tokens with triton_paged as with sdpa, with prompts prefilled in
    small chunks over their own cached prefix, and again when a second run reuses cached prefixes."""
    calls, chunks = [], set()
    store, plan = triton_attention.store_kv, triton_attention._prefill_plan

    def counted(k, *args):
        calls.append(k.shape[0])
        return store(k, *args)

    def chunks_seen(meta, *args):
        chunks.update((s.q_len, s.ctx_len) for s in meta.prefills)
        return plan(meta, *args)

    monkeypatch.setattr(triton_attention, "store_kv", counted)
    monkeypatch.setattr(triton_attention, "_prefill_plan", chunks_seen)
    base = ["pipeline.stages.decode.params.layer_ops=torch", "engine.max_num_batched_tokens=8"]
    if DEVICE == "cuda":
        base += ["device.type=cuda"]
    prompts = list(DEMO_PROMPTS)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for name in ("sdpa", "triton_paged"):
        llm = build_llm([*base, f"pipeline.stages.decode.params.attention={name}"])
        first = [o.token_ids for o in llm.generate(prompts, params)]
        again = [o.token_ids for o in llm.generate(prompts[::-1], params)][::-1]  # prefix-cache hits
        assert_drained(llm, f"attention {name}")
        outs[name] = (first, again)
    assert outs["triton_paged"] == outs["sdpa"]
    assert outs["sdpa"][0] == outs["sdpa"][1]
    assert calls and max(calls) > 1  # the kernels ran
    assert any(ctx > q_len for q_len, ctx in chunks), chunks  # chunks continuing a cached prefix among them
