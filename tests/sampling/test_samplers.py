"""The batched samplers' math (CPU): greedy, filters, seeded draws, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from litellm_pipeline import registry
from litellm_pipeline.registry.types import SamplingRow
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.sampling.samplers import GreedySampler, Sampler, apply_penalties

V = 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row(params: SamplingParams, prompt=(), output=(), gen: torch.Generator | None = None) -> SamplingRow:
    if gen is None and not params.greedy:
        gen = _gen(params.seed if params.seed is not None else 0)
    return SamplingRow(params, gen, list(prompt), list(output))


def _logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=_gen(seed)) * 3


# ---------------------------------------------------------------- registry

def test_registered_by_name():
    try:
        got = registry.get("sampler", "default")
    except ModuleNotFoundError as exc:  # another built-in module the registry imports is not written yet
        pytest.skip(f"registry built-ins incomplete: {exc}")
    assert got is Sampler
    assert registry.get("sampler", "greedy") is GreedySampler


# ---------------------------------------------------------------- greedy / filters

def test_greedy_equals_argmax_any_dtype():
    logits = _logits(5)
    rows = [_row(SamplingParams(temperature=0)) for _ in range(5)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()
    bf = logits.to(torch.bfloat16)
    assert Sampler()(bf, rows).token_ids == bf.float().argmax(-1).tolist()


def test_greedy_tie_lowest_id_and_greedy_sampler_ignores_params():
    logits = torch.zeros(1, 8)
    logits[0, 3] = logits[0, 6] = 5.0
    assert Sampler()(logits, [_row(SamplingParams(temperature=0))]).token_ids == [3]
    logits = _logits(3)
    rows = [_row(SamplingParams(temperature=1.5, seed=i, repetition_penalty=2.0), prompt=[0, 1]) for i in range(3)]
    assert GreedySampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def _special_rows(vocab: int = 1000) -> torch.Tensor:
    """Rows where a first maximum is easy to get wrong: ties, NaNs, -inf everywhere, +-0, +inf."""
    x = _logits(8, vocab, seed=3)
    x[1, 7] = x[1, 900] = x[1].max() + 1  # a tie: the lower id
    x[2, 40] = x[2, 13] = float("nan")  # NaNs win, the first one
    x[3] = float("-inf")  # all -inf: id 0
    x[4] = -1.0
    x[4, 5], x[4, 9] = -0.0, 0.0  # -0.0 == 0.0: the first of them
    x[5, 999] = float("inf")
    x[6, 0] = float("nan")
    x[7, 998] = x[7].max() + 5  # in the last vector's tail
    return x


@pytest.mark.parametrize("kernel", [False, True])
def test_greedy_picks_the_first_maximum_as_torch_max_does(kernel, monkeypatch):
    """Greedy rows take torch.max's index (first maximum, NaN first), through the C++ kernel when the engine built
    it and through torch otherwise."""
    from litellm_pipeline.model import cpu_kernels

    if kernel:
        try:
            cpu_kernels.ops()
        except Exception as exc:
            pytest.skip(f"C++ kernels unavailable: {exc}")
        assert cpu_kernels.loaded() is not None
    else:
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: None)
    for vocab in (1000, 7, 32000):
        x = _special_rows(1000) if vocab == 1000 else _logits(4, vocab, seed=vocab)
        want = x.max(-1).indices.tolist()
        rows = [_row(SamplingParams(temperature=0)) for _ in range(x.shape[0])]
        assert Sampler()(x, rows).token_ids == want and GreedySampler()(x, rows).token_ids == want
        if kernel:
            assert cpu_kernels.loaded().argmax_rows(x).tolist() == want
    x = _special_rows()
    assert x.max(-1).indices.tolist()[1:7] == [7, 13, 0, 5, 999, 0]  # the cases above are what they claim
    mixed = [_row(SamplingParams(temperature=0)) if i % 2 else _row(SamplingParams(temperature=1.0, seed=i))
             for i in range(8)]
    got = Sampler()(x.nan_to_num(nan=50.0), mixed).token_ids  # greedy rows among sampled ones
    assert [got[i] for i in range(1, 8, 2)] == [x.nan_to_num(nan=50.0)[i].max(-1).indices.item() for i in range(1, 8, 2)]


def test_greedy_rows_take_the_argmax_given_with_the_logits(monkeypatch):
    """An ``argmax`` found with the logits is what greedy rows take, alone or among sampled rows, without a second
    search; penalties change the logits, so then the greedy rows search them; sampled rows never use it."""
    from litellm_pipeline.sampling import samplers

    x = _logits(4)
    given = torch.tensor([5, 6, 7, 8])  # not the logits' argmax: shows which one was taken
    assert given.tolist() != x.argmax(-1).tolist()
    searched = []
    real = samplers._argmax
    monkeypatch.setattr(samplers, "_argmax", lambda t: searched.append(t.shape[0]) or real(t))
    greedy = [_row(SamplingParams(temperature=0)) for _ in range(4)]
    assert Sampler()(x, greedy, argmax=given).token_ids == [5, 6, 7, 8] and searched == []
    mixed = [_row(SamplingParams(temperature=0)) if i % 2 else _row(SamplingParams(temperature=1.0, seed=i))
             for i in range(4)]
    got = Sampler()(x, mixed, argmax=given).token_ids
    assert (got[1], got[3]) == (6, 8) and searched == []
    assert got[0] == Sampler()(x[:1], mixed[:1]).token_ids[0]  # the sampled row drew as it would without it
    penalised = [_row(SamplingParams(temperature=0, presence_penalty=1.0), output=[0]), *mixed[1:]]
    got = Sampler()(x, penalised, argmax=given).token_ids
    assert searched == [3] and (got[1], got[3]) == tuple(x[[1, 3]].argmax(-1).tolist())  # rows 0, 1, 3 searched


def test_top_k_one_and_tiny_top_p_equal_argmax():
    logits = _logits(6, seed=1)
    expect = logits.argmax(-1).tolist()
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        for step in range(5):
            rows = [_row(SamplingParams(temperature=1.0, seed=100 * step + i, **kw)) for i in range(6)]
            assert Sampler()(logits, rows).token_ids == expect, kw


def test_top_k_keeps_only_k_best():
    logits = _logits(1, seed=2)
    best3 = set(logits[0].topk(3).indices.tolist())
    g = _gen(5)
    seen = {Sampler()(logits, [_row(SamplingParams(top_k=3, temperature=5.0), gen=g)]).token_ids[0] for _ in range(300)}
    assert seen == best3


def test_top_p_keeps_smallest_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1} (0.5 < 0.7 needs the second one)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    g = _gen(3)
    seen = {Sampler()(logits, [_row(SamplingParams(top_p=0.7), gen=g)]).token_ids[0] for _ in range(400)}
    assert seen == {0, 1}


def test_min_p_filters():
    logits = _logits(1, seed=4)
    probs = logits[0].softmax(-1)
    min_p = 0.2
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < V  # the check below must be able to fail
    g = _gen(11)
    drawn = [Sampler()(logits, [_row(SamplingParams(min_p=min_p), gen=g)]).token_ids[0] for _ in range(500)]
    assert set(drawn) <= allowed
    assert len(set(drawn)) > 1


# ---------------------------------------------------------------- seeds

def test_same_seed_same_tokens_regardless_of_batch():
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=1234)
    alone_gen, batch_gen = _gen(1234), _gen(1234)
    others_rng = torch.Generator().manual_seed(99)
    sampler = Sampler()
    alone, batched = [], []
    for step in range(8):
        mine = _logits(1, seed=50 + step)
        alone.append(sampler(mine, [_row(params, gen=alone_gen)]).token_ids[0])
        # the same row, placed among others that have different params and their own generators
        k = 1 + step % 4
        others = torch.randn(k, V, generator=others_rng) * 3
        batch = torch.cat([others[: k // 2], mine, others[k // 2:]])
        rows = [_row(SamplingParams(temperature=1.3, seed=step * 10 + j, top_p=0.8), gen=_gen(step * 10 + j))
                for j in range(k)]
        rows.insert(k // 2, _row(params, gen=batch_gen))
        rows.append(_row(SamplingParams(temperature=0)))
        batch = torch.cat([batch, torch.randn(1, V, generator=others_rng)])
        batched.append(sampler(batch, rows).token_ids[k // 2])
    assert alone == batched


def test_different_seeds_differ():
    logits = torch.zeros(1, V)  # uniform: any two seeds agreeing on 10 draws is ~64**-10
    def run(seed):
        g = _gen(seed)
        return [Sampler()(logits, [_row(SamplingParams(seed=seed), gen=g)]).token_ids[0] for _ in range(10)]
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_temperature_distribution_matches_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    for temp in (0.7, 1.0, 2.0):
        g = _gen(7)
        rows = [_row(SamplingParams(temperature=temp), gen=g)]
        draws = torch.tensor([Sampler()(logits, rows).token_ids[0] for _ in range(5000)])
        freq = torch.bincount(draws, minlength=4).float() / 5000
        expect = (logits[0] / temp).softmax(-1)
        assert torch.allclose(freq, expect, atol=0.03), (temp, freq, expect)


# ---------------------------------------------------------------- penalties

def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    prompt, output, pen = [0, 1], [3, 1], 2.0
    expect = logits[0].clone()
    for t in set(prompt + output):
        expect[t] = expect[t] / pen if expect[t] > 0 else expect[t] * pen
    assert expect.tolist() == [1.0, -4.0, 1.0, -2.0, 0.5, 3.0]
    row = _row(SamplingParams(temperature=0, repetition_penalty=pen), prompt, output)
    got = apply_penalties(logits.clone(), [row])
    assert torch.allclose(got[0], expect)
    # end to end: token 5 (3.0) stays best; penalise it hard and token 2 or 4 must win
    row = _row(SamplingParams(temperature=0, repetition_penalty=4.0), [5], [0])
    assert Sampler()(logits, [row]).token_ids == [2]  # 3/4=0.75 < 1.0


def test_presence_frequency_penalty_formula():
    logits = _logits(2, vocab=8, seed=9)
    output = [1, 1, 1, 4, 7]
    rows = [_row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2, 3], output),
            _row(SamplingParams(), [1], output)]  # no penalty: must be untouched
    got = apply_penalties(logits.clone(), rows)
    counts = torch.bincount(torch.tensor(output), minlength=8).float()
    expect0 = logits[0] - 0.25 * counts - 0.5 * (counts > 0).float()
    assert torch.allclose(got[0], expect0)
    assert torch.equal(got[1], logits[1])
    # prompt tokens are not penalised by presence/frequency
    assert got[0, 2] == logits[0, 2] and got[0, 3] == logits[0, 3]


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    row = _row(SamplingParams(temperature=0, frequency_penalty=0.2), [], [0])
    assert Sampler()(logits, [row]).token_ids == [1]
    # input logits are not modified in place
    assert logits[0, 0] == 5.0


# ---------------------------------------------------------------- logprobs

@pytest.mark.parametrize("sampler_cls", [Sampler, GreedySampler])
def test_logprobs_are_raw_log_softmax(sampler_cls):
    logits = _logits(3, seed=12)
    rows = [
        _row(SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, seed=1), prompt=[0, 1, 2]),
        _row(SamplingParams(temperature=0, logprobs=0)),
        _row(SamplingParams(temperature=0.8, seed=2)),
    ]
    out = sampler_cls()(logits, rows)
    ref = torch.log_softmax(logits.float(), -1)
    d0, d1 = out.logprobs[0], out.logprobs[1]
    assert out.logprobs[2] is None
    top3 = ref[0].topk(3).indices.tolist()
    assert set(d0) == set(top3) | {out.token_ids[0]}
    for t, v in d0.items():
        assert math.isclose(v, ref[0, t].item(), abs_tol=1e-6)
    assert list(d1) == [out.token_ids[1]]
    assert math.isclose(d1[out.token_ids[1]], ref[1, out.token_ids[1]].item(), abs_tol=1e-6)
