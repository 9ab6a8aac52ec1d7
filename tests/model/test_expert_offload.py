"""Expert offload (moe.hot_experts): the bookkeeping of resident experts, prefetch and eviction, checked on the CPU
with a copier that defers every copy until it is waited on (so an expert used before its copy arrived computes with
stale weights and the tokens change), and engine runs that must give the tokens of the model with every expert
resident."""

from __future__ import annotations

import pytest
import torch

from litellm_pipeline import SamplingParams
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model.expert_offload import (
    ExpertOffload,
    ExpertStore,
    OffloadStats,
    predict_experts,
)
from litellm_pipeline.testing._support import DEMO_PROMPTS, assert_drained, build_llm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}


class DeferredCopier:
    """Copies land only when waited on; writing a slot whose earlier copy is still in flight is an error, and so is
    a copy started into a slot whose expert someone still waits for."""

    def __init__(self):
        self.in_flight: dict[int, tuple] = {}  # handle -> (dst, src)
        self.next = 0
        self.copies = 0

    def freed(self):
        return None

    def start(self, dst, src, after=None):
        for d, _ in self.in_flight.values():
            assert d.data_ptr() != dst.data_ptr(), "a slot was rewritten while its previous copy was in flight"
        self.next += 1
        self.in_flight[self.next] = (dst, src.clone())
        self.copies += 1
        return self.next

    def wait(self, handle):
        # copies on one stream land in order: everything up to the handle
        for h in sorted(h for h in self.in_flight if h <= handle):
            dst, src = self.in_flight.pop(h)
            dst.copy_(src)


def _store(capacity=2, experts=4, copier=None):
    w13 = torch.arange(experts, dtype=torch.float32)[:, None, None].expand(experts, 2, 3).contiguous()
    w2 = -w13[:, :1, :].clone()
    stats = OffloadStats()
    return ExpertStore(w13, w2, capacity, torch.device("cpu"), copier or DeferredCopier(), stats), stats


def test_store_counts_hits_prefetch_hits_and_misses():
    store, stats = _store(capacity=2)
    store.begin_step([0, 1])
    assert (stats.hits, stats.prefetch_hits, stats.misses) == (0, 0, 2)
    for e, later in ((0, [0, 1]), (1, [1])):
        w13, _ = store.weights(e, later)
        assert torch.all(w13 == e)  # waited for: the copy landed
    store.begin_step([1])
    assert stats.hits == 1
    assert store.prefetch([3, 1]) == 1  # 1 is resident; 3 replaces the least recently used (0)
    assert store.resident() == [1, 3] and stats.prefetched == 1
    store.begin_step([3])
    assert stats.prefetch_hits == 1
    assert torch.all(store.weights(3, [3])[0] == 3)
    assert stats.used == 4 and stats.hit_rate == pytest.approx(2 / 4)


def test_unused_prefetches_are_counted_when_evicted():
    store, stats = _store(capacity=2)
    store.prefetch([2, 3])
    store.begin_step([0])  # evicts 2 (least recently used) without anyone using it
    store.weights(0, [0])
    assert stats.prefetch_unused == 1 and store.resident() == [0, 3]


def test_more_experts_than_slots_are_loaded_in_turn_never_evicting_what_is_still_needed():
    copier = DeferredCopier()
    store, stats = _store(capacity=2, experts=5, copier=copier)
    needed = [0, 1, 2, 3, 4]
    later = list(needed)
    evictions = []
    evict = store._evict

    def watched(e):
        evictions.append((e, list(later), store.resident()))
        evict(e)

    store._evict = watched
    store.begin_step(needed)
    assert stats.misses == 5 and store.resident() == [0, 1]
    for e in needed:
        w13, w2 = store.weights(e, later)
        assert torch.all(w13 == e) and torch.all(w2 == -e), f"expert {e} used before its copy landed"
        later.remove(e)
    assert evictions, "five experts through two slots must evict"
    for victim, still_needed, resident in evictions:
        if victim in still_needed[1:]:  # evicting an expert needed later is allowed only when all residents are
            assert set(resident) <= set(still_needed), (victim, still_needed, resident)
    assert len(store.resident()) == 2 and not copier.in_flight


def test_prefetch_never_evicts_the_experts_it_is_asked_for():
    store, _ = _store(capacity=3, experts=6)
    store.prefetch([0, 1, 2])
    store.prefetch([1, 4, 5, 0])  # limited to capacity: 1, 4, 5; 1 stays, 0 and 2 may go
    assert 1 in store.resident() and {4, 5} <= set(store.resident()) and len(store.resident()) == 3


def test_predict_ranks_by_the_mass_of_each_tokens_top_k():
    gate = torch.eye(4)
    x = torch.tensor([[5.0, 4.9, 0.0, 0.0], [0.0, 4.9, 0.0, 5.0]])
    ranked = predict_experts(x, gate, 1, lambda a, w: a @ w.T)
    assert ranked == [0, 3]  # expert 1 is nobody's top-1
    assert predict_experts(x, gate, 2, lambda a, w: a @ w.T)[:1] == [1]  # second choice of both tokens


@pytest.fixture(scope="module")
def reference():
    llm = build_llm()
    return {name: [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), p)] for name, p in PARAMS.items()}


@pytest.mark.parametrize("hot", [1, 2, 5, 8])
@pytest.mark.parametrize("prefetch", [True, False])
def test_engine_tokens_equal_every_expert_resident(reference, hot, prefetch):
    llm = build_llm([f"moe.hot_experts={hot}", f"moe.prefetch={str(prefetch).lower()}"])
    off = llm.engine.rt.model.expert_offload
    assert all(s.w13.shape[0] == hot for s in off.stores) and all(s.w13_host.device.type == "cpu" for s in off.stores)
    for name, want in reference.items():
        assert [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), PARAMS[name])] == want
    st = off.stats()
    assert st.used > 0 and (st.misses > 0) == (hot < 8)
    assert (st.prefetched > 0) == (prefetch and hot < 8)
    assert_drained(llm, "expert offload")


def test_deferred_copies_in_the_engine_give_the_same_tokens(reference):
    """Every copy waits until its expert is used: a missing wait anywhere would compute with stale weights."""
    llm = build_llm(["moe.hot_experts=2"])
    model = llm.engine.rt.model
    copier = DeferredCopier()
    for store in model.expert_offload.stores:
        store.copier = copier
    assert [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), GREEDY)] == reference["greedy"]
    assert copier.copies > 0


def test_mixed_tiers_with_offload_match_without(reference):
    tiers = ["fast", "balanced", "deep", "max", "fast", "deep"]
    base = build_llm()
    want = [base.generate(p, GREEDY, tier=t)[0].token_ids for p, t in zip(DEMO_PROMPTS, tiers)]
    llm = build_llm(["moe.hot_experts=3"])
    reqs = [llm.engine.add_request(p, GREEDY, tier=t) for p, t in zip(DEMO_PROMPTS, tiers)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.output_ids for r in reqs] == want
    assert_drained(llm, "offload, mixed tiers")


def test_offload_turns_off_the_fused_all_layer_decode_but_keeps_its_ops(reference):
    llm = build_llm(["moe.hot_experts=4", "pipeline.stages.decode.params.layer_ops=cpu_fused",
                     "pipeline.stages.decode.params.attention=cpu_paged",
                     "pipeline.stages.decode.params.moe_dispatch=fused"])
    assert llm.engine.rt.model.fused_decode_layers is None
    assert [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), GREEDY)] == reference["greedy"]


def test_device_memory_holds_only_the_hot_experts():
    llm = build_llm(["moe.hot_experts=2"])
    model = llm.engine.rt.model
    full = sum(s.w13_host.numel() * 4 + s.w2_host.numel() * 4 for s in model.expert_offload.stores)
    assert model.expert_offload.device_bytes() * 4 == full  # 2 of 8 experts


@pytest.mark.parametrize("value, match", [(9, r"moe\.hot_experts: must be in 1\.\.8"), (0, r"moe\.hot_experts")])
def test_bad_hot_experts_is_a_config_error(value, match):
    with pytest.raises(ConfigError, match=match):
        build_llm([f"moe.hot_experts={value}"])


def test_dense_model_refuses_offload(hf_checkpoint):
    from litellm_pipeline import LLM

    with pytest.raises(ConfigError, match=r"moe\.hot_experts: the model is dense"):
        LLM(model=str(hf_checkpoint("llama")), overrides=["moe.hot_experts=2"])


def test_offload_of_a_mixtral_checkpoint_matches(hf_checkpoint):
    from litellm_pipeline import LLM

    path = str(hf_checkpoint("mixtral"))
    prompts = [[5, 6, 7, 8, 9], [10, 20, 30], [3, 1, 4, 1, 5, 9, 2, 6]]
    want = [o.token_ids for o in LLM(model=path).generate(prompts, GREEDY)]
    llm = LLM(model=path, overrides=["moe.hot_experts=1"])
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert isinstance(llm.engine.rt.model.expert_offload, ExpertOffload)
