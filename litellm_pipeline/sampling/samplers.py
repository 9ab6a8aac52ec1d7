"""Batched token sampling: one row of logits per running request, one token out per row.

Registered samplers (kind ``"sampler"``):

* ``default`` — penalties, greedy / temperature / min-p / top-k / top-p, per-request generators.
* ``greedy`` — argmax of the raw logits for every row, whatever the params say (logprobs still honoured).

Order per row: repetition, presence and frequency penalties -> greedy rows take the argmax -> the
others: temperature -> min-p -> top-k -> top-p -> one draw from the row's own generator. Logprobs are
``log_softmax`` of the raw logits (before penalties and temperature), in float32, as vLLM reports them.

Everything is computed in float32 whatever the logits' dtype. Work is vectorised over rows and skipped
when no row needs it; the only host sync is the final ``.tolist()`` the engine needs anyway.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from litellm_pipeline.model import cpu_kernels
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import SamplerOutput, SamplingRow

__all__ = ["SamplingRow", "SamplerOutput", "Sampler", "GreedySampler", "apply_penalties"]

_MIN_TEMPERATURE = 1e-5  # logits / T must stay finite for tiny non-zero temperatures


def _host_tensor(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row values as a device tensor without a blocking copy (pinned staging on CUDA)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _flat_ids(per_row: list[tuple[Sequence[int] | torch.Tensor, ...]], vocab: int,
              device: torch.device) -> torch.Tensor:
    """Indices ``row * vocab + token`` into a flattened ``[len(per_row), vocab]`` tensor.

    Each row may hold several id sequences (prompt, output); tensors already on ``device`` stay there,
    host ones are gathered and copied once.
    """
    host, on_dev = [], []
    for r, seqs in enumerate(per_row):
        for s in seqs:
            if isinstance(s, torch.Tensor):
                t = s.reshape(-1).to(torch.long) + r * vocab
                (on_dev if t.device == device else host).append(t)
            elif len(s):
                host.append(torch.tensor(list(s), dtype=torch.long) + r * vocab)
    if host:
        flat = torch.cat([t.cpu() for t in host])
        on_dev.append(flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device))
    return torch.cat(on_dev) if on_dev else torch.empty(0, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (HF), presence and frequency (OpenAI) penalties, in place on float32 ``logits``."""
    n, vocab = logits.shape
    dev = logits.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        # HF semantics: every token seen in prompt or output, counted once
        seen = torch.zeros(len(rep) * vocab, dtype=torch.bool, device=dev)
        seen[_flat_ids([(rows[i].prompt_ids, rows[i].output_ids) for i in rep], vocab, dev)] = True
        seen = seen.view(len(rep), vocab)
        pen = _host_tensor([rows[i].params.repetition_penalty for i in rep], torch.float32, dev).unsqueeze(1)
        idx = _host_tensor(rep, torch.long, dev)
        sub = logits[idx]
        penalised = torch.where(sub > 0, sub / pen, sub * pen)
        logits[idx] = torch.where(seen, penalised, sub)
    occ = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if occ:
        # OpenAI semantics: generated tokens only, frequency scales with the count
        flat = _flat_ids([(rows[i].output_ids,) for i in occ], vocab, dev)
        counts = torch.bincount(flat, minlength=len(occ) * vocab).view(len(occ), vocab).to(torch.float32)
        pres = _host_tensor([rows[i].params.presence_penalty for i in occ], torch.float32, dev).unsqueeze(1)
        freq = _host_tensor([rows[i].params.frequency_penalty for i in occ], torch.float32, dev).unsqueeze(1)
        idx = _host_tensor(occ, torch.long, dev)
        logits[idx] = logits[idx] - freq * counts - pres * (counts > 0).to(torch.float32)
    return logits


def _filter(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p masking (to -inf) on the sampling rows' logits."""
    dev, vocab = x.device, x.shape[1]
    temps = [max(r.params.temperature, _MIN_TEMPERATURE) for r in rows]
    if any(t != 1.0 for t in temps):
        x = x / _host_tensor(temps, torch.float32, dev).unsqueeze(1)
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        probs = x.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * _host_tensor(min_p, torch.float32, dev).unsqueeze(1)
        x = x.masked_fill(probs < floor, float("-inf"))
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    need_k, need_p = any(k < vocab for k in top_k), any(p < 1.0 for p in top_p)
    if not (need_k or need_p):
        return x
    # one stable sort serves both; ties keep the lower token id first
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if need_k:
        k = _host_tensor(top_k, torch.long, dev).unsqueeze(1)
        kth = sorted_x.gather(1, k - 1)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if need_p:
        # rows without top-p get an unreachable threshold: float32 cumsum may round to 1 before the tail
        p = _host_tensor([q if q < 1.0 else float("inf") for q in top_p], torch.float32, dev).unsqueeze(1)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop = mass_before >= p
        drop[:, 0] = False  # the most likely token always survives
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _draw(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row via the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` from the row's generator.

    Equivalent to sampling from ``p``; each row's noise comes only from its own generator, so a seeded
    request gets the same tokens whatever else is in the batch.
    """
    vocab = x.shape[1]
    noise = torch.empty_like(x)
    for i, r in enumerate(rows):
        g = r.generator
        if g is None or g.device == x.device:
            noise[i].exponential_(generator=g)
        else:  # generator lives elsewhere (e.g. CPU generator, CUDA logits): draw there, then move
            noise[i] = torch.empty(vocab, device=g.device).exponential_(generator=g).to(x.device)
    # exponential_ may return exactly 0 (u == 0); a 0/0 NaN would win the argmax
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (x.softmax(-1) / noise).argmax(-1)


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` without the call where it is float32 already (a decode step's logits)."""
    return x if x.dtype == torch.float32 else x.float()


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (a NaN counts as the maximum), as ``x.max(-1).indices``: through the C++ kernel
    for float32 CPU logits when the engine has built it (layer_ops cpu_fused / cpu_int8), else torch's."""
    ns = cpu_kernels.loaded()
    if ns is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return ns.argmax_rows(x)
    return x.max(-1).indices  # first maximum, like argmax (which is 2-3x slower on CPU)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow],
              token_list: list[int]) -> list[dict[int, float] | None]:
    """``{sampled id: logprob, top-n ids: logprobs}`` from ``log_softmax(raw)`` for rows that ask."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[dict[int, float] | None] = [None] * len(rows)
    if not want:
        return out
    idx = _host_tensor(want, torch.long, raw.device)
    lp = torch.log_softmax(raw[idx], dim=-1)
    n_top = max(rows[i].params.logprobs for i in want)
    chosen = lp.gather(1, tokens[idx].unsqueeze(1))
    top_v, top_i = lp.topk(n_top, dim=-1) if n_top else (chosen[:, :0], chosen[:, :0].long())
    vals = torch.cat([chosen, top_v], 1).tolist()
    ids = top_i.tolist()
    for j, i in enumerate(want):
        d = {token_list[i]: vals[j][0]}
        for t, v in zip(ids[j][: rows[i].params.logprobs], vals[j][1:]):
            d[t] = v
        out[i] = d
    return out


def _any_penalty(rows: Sequence[SamplingRow]) -> bool:
    return any(
        r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
        for r in rows
    )


def _no_params(name: str, params: dict) -> None:
    if params:
        raise ValueError(f"sampler {name!r} takes no parameters (got {sorted(params)})")


@register("sampler", "default")
class Sampler:
    """The default sampler: penalties, greedy / temperature / min-p / top-k / top-p, seeded per request."""

    def __init__(self, **params: Any) -> None:
        _no_params("default", params)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 argmax: torch.Tensor | None = None) -> SamplerOutput:
        """Pick one token per row of ``logits`` (``[len(rows), vocab]``, any float dtype); ``argmax``: each
        row's first maximum of the logits, where the step computed it (then, when no row has penalties, the greedy
        rows take it instead of searching the logits again, whether or not other rows sample)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        raw = _float(logits)
        penalties = _any_penalty(rows)
        x = apply_penalties(raw.clone(), rows) if penalties else raw
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sample = [i for i, r in enumerate(rows) if not r.params.greedy]
        found = argmax if not penalties else None  # the raw logits' argmax is x's where nothing changed them
        if len(greedy) == len(rows):
            tokens = found if found is not None else _argmax(x)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=raw.device)
            if greedy:
                g_idx = _host_tensor(greedy, torch.long, raw.device)
                tokens[g_idx] = found[g_idx] if found is not None else _argmax(x[g_idx])
        if sample:
            s_rows = [rows[i] for i in sample]
            if len(sample) == len(rows):
                tokens = _draw(_filter(x, s_rows), s_rows)
            else:
                s_idx = _host_tensor(sample, torch.long, raw.device)
                tokens[s_idx] = _draw(_filter(x[s_idx], s_rows), s_rows)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, tokens, rows, token_list))


@register("sampler", "greedy")
class GreedySampler:
    """Argmax of the raw logits for every row (ties: lowest id); only ``params.logprobs`` is honoured."""

    def __init__(self, **params: Any) -> None:
        _no_params("greedy", params)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 argmax: torch.Tensor | None = None) -> SamplerOutput:
        """Pick the argmax token of each row of ``logits`` (``argmax``: those, where the step computed them)."""
        raw = _float(logits)
        tokens = argmax if argmax is not None else _argmax(raw)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, tokens, rows, token_list))
