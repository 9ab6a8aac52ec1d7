"""KV eviction policies (registry kind ``kv_policy``): which unused cached block goes first."""

from __future__ import annotations

import pytest
from hf_models import random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.engine.kv_policy import LFUPolicy, LRUPolicy
from litellm_pipeline.errors import ConfigError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_lru_and_lfu_choose_different_victims():
    for cls, expect in ((LRUPolicy, 1), (LFUPolicy, 2)):
        p = cls()
        p.hit(1)  # block 1 was reused once; block 2 never
        p.add(1)
        p.add(2)
        assert p.pop() == expect, cls.__name__


@pytest.mark.parametrize("cls", [LRUPolicy, LFUPolicy])
def test_remove_and_pop_until_empty(cls):
    p = cls()
    for b in range(5):
        p.add(b)
    p.remove(2)
    assert len(p) == 4 and 2 not in p
    popped = [p.pop() for _ in range(4)]
    assert sorted(popped) == [0, 1, 3, 4] and p.pop() is None and len(p) == 0


def test_lru_evicts_the_least_recently_freed():
    p = LRUPolicy()
    for b in (3, 1, 2):
        p.add(b)
    p.remove(3)
    p.add(3)  # freed again: now the most recent
    assert [p.pop(), p.pop(), p.pop()] == [1, 2, 3]


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return str(hf_checkpoint("mixtral"))


def test_unknown_kv_policy_lists_known(ckpt):
    with pytest.raises(ConfigError) as exc:
        LLM(model=ckpt, **{"cache.kv_policy": "mru"})
    assert "mru" in str(exc.value) and "lru" in str(exc.value) and "lfu" in str(exc.value)


def test_lfu_policy_runs_end_to_end(ckpt):
    llm = LLM(model=ckpt, block_size=8, num_blocks=16, **{"cache.kv_policy": "lfu"})
    ref = LLM(model=ckpt, **{"cache.enable_prefix_caching": False})
    prompts = random_prompts((30, 50, 30), seed=19)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, GREEDY)]
    assert llm.engine.rt.pool.is_empty()


def test_lfu_heap_stays_bounded_under_reuse():
    """A block freed, hit and freed again many times leaves stale heap entries; they are compacted."""
    p = LFUPolicy()
    for b in (0, 1):
        p.add(b)
    for _ in range(300):
        p.remove(0)  # a prefix hit takes it back...
        p.hit(0)
        p.add(0)  # ...and the request frees it again
    assert len(p._heap) <= 2 * len(p) + 16 + 1
    assert p.pop() == 1 and p.pop() == 0 and p.pop() is None  # block 1 was never hit
