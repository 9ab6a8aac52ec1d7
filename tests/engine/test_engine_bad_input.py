"""Bad requests are rejected with a clear message, leave nothing behind, and disturb no one else."""

from __future__ import annotations

import pytest
from _engine_util import alone, assert_pool_empty, greedy, run_engine
from hf_models import random_prompts

from litellm_pipeline import LLM
from litellm_pipeline.errors import ConfigError

CTX = 64
CONFIG = dict(max_model_len=CTX, block_size=4, num_blocks=12)  # 48 cached tokens at most


def _bad_cases(tiers):
    p10 = random_prompts([10], seed=51)[0]
    return {
        "too-long": (random_prompts([70], seed=52)[0], greedy(4), None, ["70", str(CTX), "context"]),
        "exactly-context": (random_prompts([CTX], seed=53)[0], greedy(4), None, [str(CTX), "context"]),
        "id-out-of-vocab": ([5, 10_000, 7], greedy(4), None, ["10000", "384", "vocabulary"]),
        "negative-id": ([5, -1, 7], greedy(4), None, ["-1", "384", "vocabulary"]),
        "empty": ([], greedy(4), None, ["empty"]),
        "empty-text": ("", greedy(4), None, ["prompt: is empty"]),
        "never-fits-cache": (p10, greedy(50), None, ["KV blocks", "15", "12"]),
        "unknown-tier": (p10, greedy(4), "turbo", ["unknown tier", "turbo", *tiers]),
        "duplicate-id": (p10, greedy(4), "dup", ["already in use", "good-one"]),
        "not-unicode": ("ab\ud800", greedy(4), None, ["prompt: text is not valid Unicode", "U+D800 at character 2"]),
    }


CASES = list(_bad_cases(["fast"]))


@pytest.mark.parametrize("case", CASES)
def test_bad_request_rejected_and_others_unaffected(make_llm, case):
    llm = make_llm("llama", **CONFIG)
    eng, pool = llm.engine, llm.engine.rt.pool
    prompt, sp, tier, expected = _bad_cases(list(eng.rt.tiers))[case]
    good_p, good_sp = random_prompts([8], seed=50)[0], greedy(16)
    good = eng.add_request(good_p, good_sp, request_id="good-one")
    eng.step()
    eng.step()
    assert len(good.output_ids) == 2
    snapshot = (pool.num_free, list(pool.ref_counts), list(good.block_ids))
    assert pool.num_blocks - pool.num_free == len(good.block_ids) > 0

    kw = {"request_id": "good-one"} if tier == "dup" else {"tier": tier}
    with pytest.raises(ValueError) as info:
        eng.add_request(prompt, sp, **kw)
    msg = str(info.value)
    for part in expected:
        assert part in msg, f"{part!r} missing from the error text: {msg!r}"

    # nothing of the rejected request stayed behind
    assert (pool.num_free, list(pool.ref_counts), list(good.block_ids)) == snapshot
    assert list(eng.requests) == ["good-one"] and eng.requests["good-one"] is good
    assert list(eng.rt.scheduler.running) == [good] and not eng.rt.scheduler.waiting
    final, _ = run_engine(eng, ["good-one"])
    assert final["good-one"].token_ids == alone(llm, good_p, good_sp).token_ids
    assert final["good-one"].finish_reason == "length"
    assert_pool_empty(llm)


def test_generate_is_all_or_nothing(make_llm):
    llm = make_llm("llama", **CONFIG)
    eng, pool = llm.engine, llm.engine.rt.pool
    good_p = random_prompts([8], seed=54)[0]
    good = eng.add_request(good_p, greedy(12))
    eng.step()
    held = pool.num_blocks - pool.num_free
    others = random_prompts([6, 9], seed=55)
    with pytest.raises(ValueError, match="10000"):
        llm.generate([others[0], others[1], [3, 10_000]], greedy(4))
    assert pool.num_blocks - pool.num_free == held
    assert list(eng.requests) == [good.request_id]
    assert llm.generate([], greedy(4)) == []
    final, _ = run_engine(eng, [good.request_id])
    assert final[good.request_id].token_ids == alone(llm, good_p, greedy(12)).token_ids
    assert_pool_empty(llm)


def test_unknown_default_tier_is_a_config_error(hf_checkpoint):
    with pytest.raises(ConfigError) as info:
        LLM(model=str(hf_checkpoint("llama")), device="cpu", tier="turbo")
    msg = str(info.value)
    assert "turbo" in msg
    for name in ("fast", "balanced", "deep", "max"):
        assert name in msg


def test_text_that_is_not_unicode_is_an_invalid_request_naming_the_prompt(make_llm):
    from litellm_pipeline.errors import InvalidRequestError

    llm = make_llm("llama", **CONFIG)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("\udfffab", greedy(2))
    assert info.value.field == "prompt" and "lone surrogate U+DFFF at character 0" in str(info.value)
    assert_pool_empty(llm)
