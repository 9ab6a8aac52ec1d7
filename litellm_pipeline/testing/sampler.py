"""check_sampler: a ``sampler`` class on random logits, row by row and in batches.

The contract (``litellm_pipeline/sampling/samplers.py``): a class built as ``cls(**params)`` (the extra
``pipeline.stages.sample.params``) and called as ``sampler(logits [R, V], rows) -> SamplerOutput`` where
``rows[i]`` is a ``SamplingRow(params, generator, prompt_ids, output_ids)``: one token id and one logprobs
entry per row. What must hold for every sampler:

* one in-vocabulary token per row; a greedy row (``temperature=0``) gets its argmax, ties to the lowest id;
* the token never falls outside the row's top-k, top-p nucleus or min-p floor, taken on the distribution after
  temperature (argmax never falls outside);
* a row's token depends only on its logits, its params and its own generator: the same seed gives the same
  token alone, in any batch and at any row, and torch's global RNG is left alone;
* a row that asks for ``logprobs=n`` gets a dict holding its token and the ``n`` most likely ids, with
  ``log_softmax`` of the raw logits (within 1e-4); other rows get None.

A sampler that samples (``stochastic=True``, the default) must also draw in proportion to the probabilities:
different seeds give different tokens, and a 3:1 pair of tokens is drawn about 3:1.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from litellm_pipeline.registry.types import SamplingRow
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.testing._support import describe, resolve

V = 40


def _row(params: SamplingParams, seed: int | None = None, prompt: Sequence[int] = (), output: Sequence[int] = ()):
    gen = None if params.greedy else torch.Generator().manual_seed(seed if seed is not None else params.seed or 0)
    return SamplingRow(params, gen, list(prompt), list(output))


def _logits(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2.5).to(dtype)


class _Sampling:
    def __init__(self, sampler: Any, name: str):
        self.sampler, self.name = sampler, name

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], what: str) -> tuple[list[int], list]:
        out = self.sampler(logits, rows)
        ids, lps = list(out.token_ids), list(out.logprobs)
        assert len(ids) == len(rows) and len(lps) == len(rows), (
            f"sampler {self.name} ({what}): {len(rows)} rows gave {len(ids)} tokens and {len(lps)} logprobs entries"
        )
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < logits.shape[1]]
        assert not bad, f"sampler {self.name} ({what}): tokens {bad} are not ids in 0..{logits.shape[1] - 1}"
        return ids, lps


def _check_greedy(s: _Sampling) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        logits = _logits(6, 1, dtype)
        logits[0, 3] = logits[0, 11] = logits[0].max() + 1  # a tie: the lower id wins
        rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
        ids, _ = s(logits, rows, f"greedy rows, {dtype}")
        want = logits.float().argmax(-1).tolist()
        assert ids == want, f"sampler {s.name}: greedy rows ({dtype}) gave {ids}, their argmax (ties: lowest id) is {want}"


def _check_filters(s: _Sampling, draws: int) -> None:
    logits = _logits(1, 2)
    temp = 2.0  # hot: without the filter, tails get drawn
    probs = (logits[0] / temp).softmax(-1)  # the filters act on the tempered distribution (as vLLM's do)
    order = probs.argsort(descending=True, stable=True).tolist()
    cum = probs[order].cumsum(0) - probs[order]
    nucleus = {t for t, before in zip(order, cum.tolist()) if before < 0.6}
    allowed = {
        "top_k=3": (dict(top_k=3), set(order[:3])),
        "top_p=0.6": (dict(top_p=0.6), nucleus),
        "min_p=0.3": (dict(min_p=0.3), {t for t in range(V) if probs[t] >= 0.3 * probs.max()}),
        "top_k=1": (dict(top_k=1), {order[0]}),
    }
    for label, (kw, ok) in allowed.items():
        for i in range(draws):
            p = SamplingParams(temperature=temp, seed=i, **kw)
            (t,), _ = s(logits, [_row(p)], label)
            assert t in ok, f"sampler {s.name}: {label} allows tokens {sorted(ok)}, seed {i} drew {t}"


def _check_seeds(s: _Sampling, stochastic: bool) -> None:
    logits = _logits(5, 3)
    params = [SamplingParams(temperature=1.0, seed=10 + i) for i in range(5)]
    state = torch.random.get_rng_state()
    batch, _ = s(logits, [_row(p) for p in params], "a seeded batch")
    assert torch.equal(state, torch.random.get_rng_state()), (
        f"sampler {s.name}: drawing for seeded rows changed torch's global RNG (draw only from each row's generator)"
    )
    again, _ = s(logits, [_row(p) for p in params], "the same seeded batch")
    assert again == batch, f"sampler {s.name}: the same seeds gave {again}, before {batch}"
    alone = [s(logits[i : i + 1], [_row(p)], "a seeded row alone")[0][0] for i, p in enumerate(params)]
    assert alone == batch, f"sampler {s.name}: seeded rows alone gave {alone}, in one batch {batch}"
    rev, _ = s(logits.flip(0), [_row(p) for p in reversed(params)], "the batch reversed")
    assert rev[::-1] == batch, f"sampler {s.name}: reversing the batch changed the tokens ({rev[::-1]} vs {batch})"
    mixed = [_row(SamplingParams(temperature=0.0))] + [_row(p) for p in params]
    got, _ = s(torch.cat([_logits(1, 9), logits]), mixed, "seeded rows after a greedy row")
    assert got[1:] == batch, f"sampler {s.name}: a greedy row in front changed the seeded rows' tokens"
    if not stochastic:
        return
    flat = torch.zeros(1, V)
    seen = {s(flat, [_row(SamplingParams(temperature=1.0, seed=i))], "uniform logits")[0][0] for i in range(24)}
    assert len(seen) > 1, f"sampler {s.name}: 24 seeds over uniform logits all drew {seen}: it does not sample"
    pair = torch.full((1, V), float("-inf"))
    pair[0, 4], pair[0, 9] = 0.0, torch.tensor(3.0).log()  # probabilities 1/4 and 3/4
    nines = sum(s(pair, [_row(SamplingParams(temperature=1.0, seed=i))], "a 1:3 pair")[0][0] == 9 for i in range(400))
    assert 255 <= nines <= 345, (
        f"sampler {s.name}: token 9 has probability 0.75 but was drawn {nines} times in 400 (expected 255-345)"
    )


def _check_logprobs(s: _Sampling) -> None:
    logits = _logits(3, 4)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=5)), _row(SamplingParams(temperature=0.0)),
            _row(SamplingParams(temperature=1.0, seed=1, logprobs=0))]
    ids, lps = s(logits, rows, "rows asking for logprobs")
    ref = torch.log_softmax(logits.double(), -1)
    assert lps[1] is None, f"sampler {s.name}: a row without logprobs got {lps[1]!r} (must be None)"
    for i, n in ((0, 5), (2, 0)):
        d = lps[i]
        assert isinstance(d, dict) and ids[i] in d, f"sampler {s.name}: row {i} asked for logprobs={n}; got {d!r}"
        top = set(ref[i].topk(n).indices.tolist()) if n else set()
        assert top <= set(d), f"sampler {s.name}: row {i} logprobs={n} must hold the top ids {sorted(top)}, has {sorted(d)}"
        for t, lp in d.items():
            assert abs(lp - float(ref[i, t])) <= 1e-4, (
                f"sampler {s.name}: row {i} logprob of token {t} is {lp}, log_softmax of the raw logits is "
                f"{float(ref[i, t]):.6f}"
            )


def check_sampler(impl: str | type, params: dict[str, Any] | None = None, *, stochastic: bool = True,
                  draws: int = 40) -> None:
    """Check a ``sampler`` class (a registry name or the class), built with ``params``.

    Greedy rows and ties, top-k / top-p / min-p over ``draws`` seeds each at temperature 2, seeded determinism
    (again, alone, reversed, after a greedy row, without touching the global RNG) and logprobs. A sampler that
    ignores the sampling parameters (like ``greedy``) passes with ``stochastic=False``, which skips the checks
    that it really samples. Raises ``AssertionError`` naming the case.
    """
    cls = resolve("sampler", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    s = _Sampling(cls(**(params or {})), name)
    _check_greedy(s)
    _check_filters(s, draws)
    _check_seeds(s, stochastic)
    _check_logprobs(s)
