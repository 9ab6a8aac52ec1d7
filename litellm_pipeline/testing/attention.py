"""check_attention: an ``attention`` entry against a float64 reference on random paged steps.

The contract (``litellm_pipeline/model/attention.py``): ``attn(q, k, v, k_cache, v_cache, meta, scale,
sliding_window) -> out`` with q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (strided views of one fused projection, as
the model hands them over), caches ``[num_slots, Hk, D]``. It writes the new K/V into ``meta.slot_mapping``
(and nothing else into the caches), then attends every token causally over its own sequence's context only,
read through that sequence's slots: prefill chunks (``meta.prefills``, possibly continuing a cached prefix),
then the decode group (``meta.decode_rows`` with padded ``decode_kv_slots``). Query head ``h`` reads KV head
``h // (Hq // Hk)`` (GQA/MQA); a sliding window ``W`` lets position ``p`` see keys ``p - W < key <= p``.

The reference is written out here in float64 (no torch SDPA), so the built-in ``sdpa`` is checked too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from litellm_pipeline.registry.types import AttentionMetadata, SeqAttention
from litellm_pipeline.testing._support import describe, resolve

# Stated tolerances of the output against the float64 reference (|out - ref| <= atol + rtol * |ref|): float32
# leaves room for another summation order or an online softmax; the half types round the output itself (2^-8
# relative for bfloat16) and may keep their probabilities in that type.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AttentionCase:
    """One step's shape: decode contexts, ``(q_len, ctx_len)`` prefill chunks, heads, head dim, paging."""

    name: str
    decode_ctx: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]
    heads: tuple[int, int]  # (query heads, KV heads)
    head_dim: int
    block_size: int
    window: int | None = None
    scale: float | None = None  # None: head_dim ** -0.5
    score_gain: float = 1.0  # > 1: large scores, to catch a softmax that overflows


FIXED_CASES = (
    AttentionCase("decode-gqa", (1, 5, 17, 40, 33), (), (8, 2), 32, 4),
    AttentionCase("prefill-fresh-and-cached-mha", (), ((12, 12), (5, 40), (1, 20), (30, 50)), (4, 4), 16, 16),
    AttentionCase("mixed-mqa-window", (2, 64, 31), ((9, 9), (6, 25)), (4, 1), 64, 8, window=5),
    AttentionCase("mixed-gqa-block1-scale", (3, 11), ((7, 7), (4, 13)), (6, 3), 24, 1, scale=0.1),
    AttentionCase("decode-large-scores", (60, 150, 7), ((20, 20),), (4, 2), 32, 16, score_gain=12.0),
)


def random_cases(n: int, seed: int) -> list[AttentionCase]:
    """``n`` random steps: heads (MHA, GQA, MQA), head dims, block sizes, windows, decode and prefill mixes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hk = rng.choice((1, 2, 4))
        hq = hk * rng.choice((1, 2, 4))
        decode = tuple(rng.randint(1, 70) for _ in range(rng.randint(0, 4)))
        prefills = []
        for _ in range(rng.randint(0 if decode else 1, 3)):
            ctx = rng.randint(1, 60)
            prefills.append((ctx if rng.random() < 0.5 else rng.randint(1, ctx), ctx))
        out.append(AttentionCase(
            f"random-{seed}-{i}", decode, tuple(prefills), (hq, hk), rng.choice((16, 32, 64)),
            rng.choice((1, 4, 8, 16)), window=rng.choice((None, None, rng.randint(1, 12))),
        ))
    return out


def make_step(case: AttentionCase, dtype: torch.dtype, device: str | torch.device, seed: int):
    """Random caches and one step of ``case``: every sequence owns randomly placed blocks of a shared pool, so
    its slots are scattered as the real pool's are, and the decode table is padded with slot 0 (real data of
    another sequence, which must not be attended)."""
    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    hq, hk = case.heads
    d = case.head_dim
    lens = [c for _, c in case.prefills] + list(case.decode_ctx)
    nblk = [-(-c // bs) for c in lens]
    total = sum(nblk) + 3  # a few blocks nobody owns
    perm = torch.randperm(total, generator=g)
    seq_slots, at = [], 0
    for c, n in zip(lens, nblk):
        blocks = perm[at : at + n]
        at += n
        pos = torch.arange(c)
        seq_slots.append(blocks[pos // bs] * bs + pos % bs)
    k_cache = torch.randn(total * bs, hk, d, generator=g)
    v_cache = torch.randn(total * bs, hk, d, generator=g)
    if case.score_gain != 1.0:  # later slots get ever larger keys: scores in the hundreds
        k_cache *= torch.linspace(0.1, case.score_gain, k_cache.shape[0])[:, None, None]
    seqs, slot_map, row = [], [], 0
    for (q_len, c), sl in zip(case.prefills, seq_slots):
        seqs.append(SeqAttention(q_start=row, q_len=q_len, ctx_len=c, kv_slots=sl.to(device)))
        slot_map.append(sl[c - q_len :])
        row += q_len
    kw: dict[str, Any] = {}
    if case.decode_ctx:
        lmax = max(case.decode_ctx)
        table = torch.zeros(len(case.decode_ctx), lmax, dtype=torch.long)
        for i, sl in enumerate(seq_slots[len(case.prefills) :]):
            table[i, : len(sl)] = sl
            slot_map.append(sl[-1:])
        kw = dict(decode_rows=torch.arange(row, row + len(case.decode_ctx), device=device),
                  decode_kv_slots=table.to(device), decode_ctx_lens=torch.tensor(case.decode_ctx, device=device))
        row += len(case.decode_ctx)
    meta = AttentionMetadata(slot_mapping=torch.cat(slot_map).to(device),
                             positions=torch.zeros(row, dtype=torch.long, device=device), prefills=seqs, **kw)
    qkv = torch.randn(row, hq + 2 * hk, d, generator=g)
    if case.score_gain != 1.0:
        qkv[:, :hq] *= case.score_gain
    qkv = qkv.to(device=device, dtype=dtype)
    q, k, v = qkv.split([hq, hk, hk], dim=1)  # strided views, as the model's split of its fused projection
    return q, k, v, k_cache.to(device=device, dtype=dtype), v_cache.to(device=device, dtype=dtype), meta


def reference_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None):
    """Float64 paged attention, one sequence at a time, straight from the definition; returns (out, k, v caches)."""
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    kc[meta.slot_mapping] = k.double()
    vc[meta.slot_mapping] = v.double()
    qd = q.double()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(qd.shape, dtype=torch.float64, device=q.device)

    def attend(rows: torch.Tensor, slots: torch.Tensor, first_pos: int) -> None:
        keys = kc[slots].repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vals = vc[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qd[rows], keys) * scale
        qpos = torch.arange(first_pos, first_pos + len(rows), device=q.device)[:, None]
        kpos = torch.arange(len(slots), device=q.device)[None, :]
        ok = kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
        probs = scores.masked_fill(~ok, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, vals)

    for s in meta.prefills:
        attend(torch.arange(s.q_start, s.q_start + s.q_len, device=q.device), s.kv_slots, s.ctx_len - s.q_len)
    if meta.decode_rows is not None:
        for b in range(len(meta.decode_rows)):
            n = int(meta.decode_ctx_lens[b])
            attend(meta.decode_rows[b : b + 1], meta.decode_kv_slots[b, :n], n - 1)
    return out, kc, vc


def _check_case(attn: Callable, name: str, case: AttentionCase, dtype, device, seed: int) -> None:
    q, k, v, k_cache, v_cache, meta = make_step(case, dtype, device, seed)
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    ref, ref_k, ref_v = reference_attention(q, k, v, k_cache, v_cache, meta, scale, case.window)
    where = f"attention {name}, case {case.name} ({dtype}, heads {case.heads}, head_dim {case.head_dim}, " \
            f"block_size {case.block_size}, window {case.window})"
    out = attn(q, k, v, k_cache, v_cache, meta, scale, case.window)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype, (
        f"{where}: must return a tensor shaped like q {tuple(q.shape)} {q.dtype}, "
        f"got {getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')}"
    )
    for cache, want, which in ((k_cache, ref_k, "k_cache"), (v_cache, ref_v, "v_cache")):
        # index_copy of the inputs is exact: the new rows bit for bit, every other slot untouched
        bad = (cache.double() != want).any(-1).any(-1).nonzero().flatten().tolist()
        assert not bad, (
            f"{where}: {which} differs from 'old cache with the new K/V written at meta.slot_mapping' at slots "
            f"{bad[:8]} (new K/V must go exactly to their slots, and no other slot may change)"
        )
    assert torch.isfinite(out).all(), f"{where}: the output holds inf/NaN"
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    err = (out.double() - ref).abs() - rtol * ref.abs()
    if err.max() > atol:
        row, head, _ = _divmod_index(int(err.argmax()), err.shape)
        raise AssertionError(
            f"{where}: output differs from the float64 reference by {float((out.double() - ref).abs().max()):.3g} "
            f"(tolerance {atol:g} + {rtol:g}*|ref|), worst at token row {row}, query head {head} "
            f"({_row_kind(meta, row)})"
        )


def _divmod_index(flat: int, shape: torch.Size) -> tuple[int, int, int]:
    row, rest = divmod(flat, shape[1] * shape[2])
    head, col = divmod(rest, shape[2])
    return row, head, col


def _row_kind(meta: AttentionMetadata, row: int) -> str:
    for i, s in enumerate(meta.prefills):
        if s.q_start <= row < s.q_start + s.q_len:
            return f"prefill chunk {i}: q_len {s.q_len}, ctx_len {s.ctx_len}, query {row - s.q_start}"
    return "a decode token"


def check_attention(
    impl: str | Callable,
    *,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    device: str | torch.device = "cpu",
    random_steps: int = 6,
    seed: int = 0,
) -> int:
    """Check an ``attention`` entry (a registry name or the function) against the float64 reference.

    Runs the fixed cases (decode-only GQA, fresh prompts and chunks over cached prefixes, MQA with a sliding
    window, block size 1 with an explicit scale, large scores) and ``random_steps`` random steps in every dtype of
    ``dtypes`` on ``device``. Asserts the output's shape and dtype, that exactly the new K/V were written into the
    caches, that it is finite, and that it is within :data:`TOLERANCES` of the reference. Returns the number of
    steps checked; raises ``AssertionError`` naming the case, dtype, row and head at the first failure.
    """
    attn = resolve("attention", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    assert callable(attn), f"attention {name} is not callable"
    cases = [*FIXED_CASES, *random_cases(random_steps, seed)]
    n = 0
    for dtype in dtypes:
        for i, case in enumerate(cases):
            _check_case(attn, name, case, dtype, device, seed * 1000 + i)
            n += 1
    return n
