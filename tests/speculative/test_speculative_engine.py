"""Speculation inside the engine: budgets, chunked prefill, stop strings, logprobs, streaming, sessions, the prefix
cache, determinism, per-request control, back-off where drafts fail, metrics and bad settings."""

from __future__ import annotations

import pytest
from _engine_util import assert_pool_empty, greedy
from hf_models import random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.errors import ConfigError, InvalidRequestError
from litellm_pipeline import registry
from litellm_pipeline.registry import register

# batches verify drafts too, and every step drafts (the adaptive choice is tested on its own)
NGRAM = ["speculative=ngram", "speculative.disable_by_batch_size=null", "speculative.adaptive=false"]


def _llm(path, *overrides, **kw):
    return LLM(model=str(path), dtype="float32", device="cpu", overrides=list(overrides), **kw)


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return hf_checkpoint("llama")


def _prompts():
    ps = random_prompts([7, 30, 11], seed=3)
    return [p * 2 for p in ps]  # each repeats itself: prompt lookup drafts


def test_small_step_budget_and_tiny_pool(path):
    sp = greedy(40)
    ref = [o.token_ids for o in _llm(path).generate(_prompts(), sp)]
    for extra in (["engine.max_num_batched_tokens=8"],
                  ["cache.block_size=4", "cache.num_blocks=30"],
                  ["cache.block_size=4", "cache.num_blocks=30", "engine.preemption=swap", "cache.warm_blocks=64"]):
        llm = _llm(path, *NGRAM, *extra)
        outs = llm.generate(_prompts(), sp)
        assert [o.token_ids for o in outs] == ref, extra
        assert sum(o.num_accepted_tokens for o in outs) > 0, extra
        assert_pool_empty(llm)


def test_stop_strings_max_tokens_logprobs_and_streaming(path):
    plain, spec = _llm(path), _llm(path, *NGRAM)
    prompt = _prompts()[0]
    for sp in (greedy(23, logprobs=2), SamplingParams(temperature=0, max_tokens=30, stop=["e"], logprobs=1)):
        a, b = plain.generate(prompt, sp)[0], spec.generate(prompt, sp)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert len(b.logprobs) == len(b.token_ids)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    sp = greedy(25)
    deltas = list(spec.stream(prompt, sp))
    ref = plain.generate(prompt, sp)[0]
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert "".join(d.text for d in deltas) == ref.text
    assert any(len(d.token_ids) > 1 for d in deltas)  # verified drafts arrive several tokens at a time
    assert_pool_empty(spec)


def test_sessions_and_prefix_cache_hold_only_kept_tokens(path):
    spec = _llm(path, *NGRAM, "cache.block_size=4")
    plain = _llm(path, "cache.block_size=4")
    prompt = _prompts()[0]
    first = spec.generate(prompt, greedy(20), session_id="s")[0]
    assert first.num_accepted_tokens > 0
    follow = list(prompt) + first.token_ids + [70, 71, 72]
    again = spec.generate(follow, greedy(12), session_id="s")[0]
    # every full block of the first turn (prompt and kept output) is found again
    assert again.num_cached_tokens == (len(prompt) + len(first.token_ids) - 1) // 4 * 4
    assert again.token_ids == plain.generate(follow, greedy(12))[0].token_ids
    spec.engine.end_session("s")
    assert_pool_empty(spec)


def test_deterministic_engine_seeded_sampling_does_not_depend_on_the_batch(path):
    llm = _llm(path, *NGRAM, "engine.deterministic=true")
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=4, ignore_eos=True)
    ps = _prompts()
    batched = [o.token_ids for o in llm.generate(ps, sp)]
    alone = [llm.generate(p, sp)[0].token_ids for p in ps]
    assert batched == alone
    assert [o.token_ids for o in llm.generate(ps, sp)] == batched  # and reproducible
    g = greedy(24)
    assert [o.token_ids for o in llm.generate(ps, g)] == [o.token_ids for o in _llm(path).generate(ps, g)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(path, deterministic):
    """One draw per output token, drafted or not: a seeded request's tokens do not depend on the drafts."""
    extra = ["engine.deterministic=true"] if deterministic else []
    sp = SamplingParams(temperature=0.9, top_k=50, max_tokens=30, seed=21, ignore_eos=True)
    ps = _prompts()
    ref = [o.token_ids for o in _llm(path, *extra).generate(ps, sp)]
    spec = _llm(path, *NGRAM, *extra)
    outs = spec.generate(ps, sp)
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert [o.token_ids for o in outs] == ref
    assert [spec.generate(p, sp)[0].token_ids for p in ps] == ref


def test_per_request_k(path):
    llm = _llm(path, *NGRAM, "speculative.k=4")
    prompt = _prompts()[0]
    off = llm.generate(prompt, greedy(24), num_speculative_tokens=0)[0]
    assert off.num_draft_tokens == 0
    asked: list[int] = []
    prop = llm.engine.speculator.proposer
    original = prop.propose
    prop.propose = lambda reqs, ks: (asked.extend(ks), original(reqs, ks))[1]
    one = llm.generate(prompt, greedy(24), num_speculative_tokens=1)[0]
    assert asked and set(asked) == {1} and one.num_draft_tokens > 0
    asked.clear()
    full = llm.generate(prompt, greedy(24))[0]
    assert max(asked) == 4
    assert one.token_ids == off.token_ids == full.token_ids
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        llm.generate(prompt, greedy(4), num_speculative_tokens=-1)


def test_failing_drafts_back_off(path, steady_steps):
    with registry.isolated():
        @register("proposer", "wrong")
        class Wrong:
            """Drafts a token the model never picks here (the pad id)."""

            def __init__(self, rt):
                pass

            def propose(self, reqs, ks):
                return [[2] * k for k in ks]

        sp = greedy(64)
        prompt = _prompts()[0]
        ref = _llm(path).generate(prompt, sp)[0]
        adaptive = _llm(path, "speculative.method=wrong").generate(prompt, sp)[0]
        fixed = _llm(path, "speculative.method=wrong", "speculative.adaptive=false").generate(prompt, sp)[0]
    assert adaptive.token_ids == fixed.token_ids == ref.token_ids
    assert adaptive.num_accepted_tokens == fixed.num_accepted_tokens == 0
    # at a quarter step per verified row: k drafted twice (nothing measured yet, then that first time held back
    # as a possible warm-up), then no draft pays for an acceptance of 0.23 and below: only a try of another k now
    # and then (1% of the time)
    assert 8 <= adaptive.num_draft_tokens <= 8 + 4
    # every step drafts what max_tokens leaves room for: 4 at outputs 1..59, then 3, 2, 1
    assert fixed.num_draft_tokens == 4 * 59 + 3 + 2 + 1


def test_prometheus_counts_drafts(path):
    llm = _llm(path, *NGRAM, "telemetry.sinks=[prometheus]")
    outs = llm.generate(_prompts(), greedy(30))
    text = llm.engine.bus.sinks[0].render().decode()
    drafted, kept = sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)
    assert kept > 0
    assert f"litellm_pipeline:spec_decode_num_draft_tokens_total {float(drafted)}" in text
    assert f"litellm_pipeline:spec_decode_num_accepted_tokens_total {float(kept)}" in text
    assert 'litellm_pipeline:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


def test_bad_settings_name_what_is_wrong(path, hf_checkpoint):
    with pytest.raises(ConfigError, match="speculative.method.*ngram"):
        _llm(path, "speculative.method=nope")
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        _llm(path, "speculative=tier")
    with pytest.raises(ConfigError, match="speculative.model"):
        _llm(path, "speculative=draft")
    with pytest.raises(ConfigError, match="vocabulary"):
        from litellm_pipeline.demo import demo_checkpoint

        _llm(path, "speculative=draft", f"speculative.model={demo_checkpoint()}")
    with pytest.raises(ConfigError, match="speculative.k"):
        _llm(path, "speculative=ngram", "speculative.k=0")
    with pytest.raises(ConfigError, match="min_n"):
        _llm(path, "speculative=ngram", "speculative.params.min_n=5")


def test_no_drafts_past_the_batch_limit(path):
    ps = _prompts() * 2  # six requests
    sp = greedy(20)
    busy = _llm(path, *NGRAM, "speculative.disable_by_batch_size=4").generate(ps, sp)
    assert sum(o.num_draft_tokens for o in busy[:4]) == 0  # all six run together: no drafts until two finish
    free = _llm(path, *NGRAM, "speculative.disable_by_batch_size=null").generate(ps, sp)
    assert sum(o.num_draft_tokens for o in free) > 0
    assert [o.token_ids for o in busy] == [o.token_ids for o in free]


def test_cost_record_reports_the_speculative_work():
    from litellm_pipeline.demo import demo_checkpoint  # noqa: F401  (the default model)

    llm = LLM(tier="max", overrides=["speculative=tier", "speculative.adaptive=false"])
    out = llm.generate("copy:abc12x=", SamplingParams(temperature=0, max_tokens=12))[0]
    c = out.cost
    assert (c.draft_tokens, c.accepted_tokens) == (out.num_draft_tokens, out.num_accepted_tokens)
    assert c.draft_tokens > 0
    tiers = llm.engine.rt.tiers
    want = ((c.draft_tokens - c.accepted_tokens) * tiers["max"].price.output_1k
            + c.draft_tokens * tiers["fast"].price.output_1k) / 1000
    assert abs(c.speculation_monetary - want) < 1e-12
    assert c.monetary == tiers["max"].price.of(len(out.prompt_token_ids), len(out.token_ids))  # output only


def test_a_failing_proposer_costs_its_drafts_not_the_requests(path):
    calls = {"propose": 0, "fill": 0}
    with registry.isolated():
        @register("proposer", "broken")
        class Broken:
            """Raises in propose every other step and in fill always."""

            def __init__(self, rt):
                pass

            def propose(self, reqs, ks):
                calls["propose"] += 1
                if calls["propose"] % 2:
                    raise RuntimeError("propose broke")
                return [[5] * k for k in ks]

            def fill(self, reqs):
                calls["fill"] += 1
                raise RuntimeError("fill broke")

        llm = _llm(path, "speculative.method=broken", "speculative.disable_by_batch_size=null",
                   "speculative.adaptive=false")
        sp = greedy(16)
        outs = llm.generate(_prompts(), sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _llm(path).generate(_prompts(), sp)]
    assert all(o.finish_reason == "length" and o.num_draft_tokens == 0 for o in outs)
    assert calls["fill"] > 0 and llm.engine.speculator.failures == calls["fill"] + (calls["propose"] + 1) // 2
    assert_pool_empty(llm)
