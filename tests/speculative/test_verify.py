"""Verification keeps the target's distribution exactly: sampled with a draft, a request's tokens are distributed
as they are sampled one at a time, for temperature, top-k, top-p, min-p and penalties (checked statistically on a
tiny vocabulary, as the sampler's own tests do)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.stages.sample import Sample

V = 6
N = 6000
PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=0.9, repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3),
]


def _requests(params, draft, seed0):
    return [SimpleNamespace(params=params, generator=torch.Generator().manual_seed(seed0 + i), prompt_ids=[0, 1],
                            output_ids=[2], draft=list(draft), matcher=None) for i in range(N)]


def _stage():
    return Sample(SimpleNamespace())


def _pairs(samples):
    """Per request: (first token, second token or -1), the second only where the first was the drafted one."""
    out, cur = [], None
    for s in samples:
        if cur is not None and s.request is cur[0]:
            if cur[2] == -1:
                cur[2] = s.token_id
            continue
        if cur is not None:
            out.append((cur[1], cur[2]))
        cur = [s.request, s.token_id, -1]
    out.append((cur[1], cur[2]))
    return out


def _hist(values, n):
    return torch.bincount(torch.tensor(values), minlength=n).double()


@pytest.mark.parametrize("kw", PARAMS, ids=lambda kw: ",".join(kw))
def test_first_two_tokens_follow_the_target(kw):
    params = SamplingParams(max_tokens=8, **kw)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, V, generator=g) * 1.5  # logits after [out], after [out, d0], after [out, d0, d1]
    draft = [int(rows[0].argmax()), int(rows[1].argmin())]  # a likely first token, an unlikely second one
    stage = _stage()
    # with the draft: one sampler call over every request's 3 rows
    reqs = _requests(params, draft, 1000)
    ctx = SimpleNamespace(sample_requests=reqs, logits=rows.repeat(N, 1))
    stage(ctx)
    spec = _pairs(ctx.samples)
    # without: first token alone, then (for those that drew d0) the second with d0 appended
    plain_reqs = _requests(params, [], 50_000)
    ctx1 = SimpleNamespace(sample_requests=plain_reqs, logits=rows[0].repeat(N, 1))
    stage(ctx1)
    firsts = [s.token_id for s in ctx1.samples]
    follow = [r for r, t in zip(plain_reqs, firsts) if t == draft[0]]
    for r in follow:
        r.output_ids = [2, draft[0]]
    ctx2 = SimpleNamespace(sample_requests=follow, logits=rows[1].repeat(len(follow), 1))
    stage(ctx2)
    seconds = [s.token_id for s in ctx2.samples]

    # first token: both follow the same distribution (two-sample chi-square, V-1 dof, p ~ 1e-4 bound)
    a, b = _hist([f for f, _ in spec], V), _hist(firsts, V)
    _same(a, b, "first")
    # second token where the first was the draft's: the same again
    a2 = _hist([s for f, s in spec if f == draft[0]], V)
    b2 = _hist(seconds, V)
    _same(a2, b2, "second")
    # whatever the first, the output never holds a rejected draft token after a mismatch
    for f, s in spec:
        assert s == -1 or f == draft[0]


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    k1, k2 = (nb / na).sqrt(), (na / nb).sqrt()
    chi2 = float((((k1 * a - k2 * b) ** 2) / (a + b)).sum())
    dof = int(keep.sum()) - 1
    # chi-square quantile at 1 - 1e-4 for dof <= 5 is below 25.8
    assert chi2 < 25.8, f"{what} token: chi2 {chi2:.1f} over {dof} dof\n{a}\n{b}"


def test_greedy_keeps_the_draft_while_it_is_the_argmax():
    rows = torch.tensor([[0.0, 3, 1, 0, 0, 0], [0, 0, 0, 5, 0, 0], [1, 0, 0, 0, 0, 0]])
    params = SamplingParams(temperature=0, max_tokens=8)
    for draft, want in [([1, 3], [1, 3, 0]), ([1, 2], [1, 3]), ([2, 3], [1])]:
        req = SimpleNamespace(params=params, generator=None, prompt_ids=[0], output_ids=[2], draft=draft,
                              matcher=None)
        ctx = SimpleNamespace(sample_requests=[req], logits=rows.clone())
        _stage()(ctx)
        assert [s.token_id for s in ctx.samples] == want


def test_seeded_verification_is_reproducible():
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    rows = torch.randn(3, V, generator=torch.Generator().manual_seed(3))

    def run():
        reqs = _requests(params, [1, 2], 77)[:50]
        ctx = SimpleNamespace(sample_requests=reqs, logits=rows.repeat(50, 1))
        _stage()(ctx)
        return [(id(s.request) and reqs.index(s.request), s.token_id) for s in ctx.samples]

    assert run() == run()
