"""The conformance kit (litellm_pipeline.testing): every built-in passes it, and a deliberately broken
implementation of every checked kind fails it with a message that names what broke."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from litellm_pipeline import registry
from litellm_pipeline.budget.solvers import GreedySolver
from litellm_pipeline.engine.kv_policy import LRUPolicy
from litellm_pipeline.engine.scheduler import FcfsScheduler
from litellm_pipeline.model.attention import sdpa_paged_attention
from litellm_pipeline.model.layer_ops import TorchLayerOps
from litellm_pipeline.model.moe import packed_dispatch
from litellm_pipeline.registry.types import RoutePlan, SamplerOutput, Solution
from litellm_pipeline.sampling.samplers import Sampler
from litellm_pipeline.stages.base import Stage
from litellm_pipeline.telemetry import MemorySink
from litellm_pipeline.testing import (
    check_attention,
    check_budget_solver,
    check_constraint,
    check_proposer,
    check_kv_policy,
    check_layer_ops,
    check_moe_dispatch,
    check_router,
    check_sampler,
    check_scheduler,
    check_stage,
    check_telemetry_sink,
)
from litellm_pipeline.tiers.router import TierSetRouter

# every built-in entry, per kind; test_every_builtin_is_listed keeps this in step with the registry
BUILTINS = {
    "attention": ["cpu_paged", "sdpa", "triton_paged"],
    "layer_ops": ["cpu_fused", "cpu_int4", "cpu_int8", "torch", "triton"],
    "moe_dispatch": ["fused", "packed", "triton_fused"],
    "kv_policy": ["lfu", "lru"],
    "budget_solver": ["exact", "greedy"],
    "router": ["tierset"],
    "sampler": ["default", "greedy"],
    "scheduler": ["fair", "fcfs", "priority"],
    "telemetry": ["memory", "none", "prometheus"],
    "constraint": ["choice", "grammar", "json_object", "json_schema", "regex"],
    "proposer": ["draft", "ngram", "tier"],
    "stage": ["admit", "decode", "emit", "prefill", "route", "sample", "select_tier"],
}


# one thread: these runs are many and small, and 2 threads only add contention on a 2-core machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_builtin_is_listed():
    for kind in registry.KINDS:
        found = []
        for n in registry.names(kind):
            try:
                obj = registry.get(kind, n)
            except registry.RegistryError:  # a broken plugin entry in this environment: not a built-in
                continue
            if getattr(obj, "__module__", "").startswith("litellm_pipeline."):
                found.append(n)
        found.sort()
        assert found == sorted(BUILTINS[kind]), f"built-in {kind} entries changed: {found}"


# -- built-ins pass -------------------------------------------------------------------------------------------


def cpu_entries(kind: str) -> list[str]:
    """The Triton entries run the kit in tests/model/test_triton_*.py (under the interpreter on a CPU)."""
    return [n for n in BUILTINS[kind] if not n.startswith("triton")]


@pytest.mark.parametrize("name", cpu_entries("attention"))
def test_builtin_attention(name):
    assert check_attention(name) == 3 * 11  # 5 fixed + 6 random steps in each of 3 dtypes


@pytest.mark.parametrize("name", cpu_entries("layer_ops"))
def test_builtin_layer_ops(name):
    # cpu_int8 / cpu_int4 are lossy by design: their engine-level drift bounds are in tests/model/test_int8_ops.py
    # and tests/model/test_int4_ops.py
    check_layer_ops(name, engine=name not in ("cpu_int8", "cpu_int4"))


@pytest.mark.parametrize("name", cpu_entries("moe_dispatch"))
def test_builtin_moe_dispatch(name):
    check_moe_dispatch(name)


@pytest.mark.parametrize("name", BUILTINS["kv_policy"])
def test_builtin_kv_policy(name):
    seen = check_kv_policy(name)
    assert seen["scripted"] == 6 and seen["random"] > 100 and seen["engine"] > 0


@pytest.mark.parametrize("name", BUILTINS["budget_solver"])
def test_builtin_budget_solver(name):
    assert check_budget_solver(name, optimal=name == "exact") > 150


@pytest.mark.parametrize("name", BUILTINS["router"])
def test_builtin_router(name):
    seen = check_router(name)
    assert seen["scripted"] == 40 and seen["engine"] > 5


@pytest.mark.parametrize("name", BUILTINS["sampler"])
def test_builtin_sampler(name):
    check_sampler(name, stochastic=name != "greedy")


# values each built-in constraint kind must compile, and values it must refuse
CONSTRAINT_CASES = {
    "json_schema": ([{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                       "b": {"enum": ["x", "y"]}, "c": {"type": "string", "maxLength": 4}},
                      "required": ["a", "b", "c"]},
                     {"schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, "strict": False}],
                    ["not a schema", {"type": "strin"}, {"schema": {"type": "object"}, "strict": "yes"}]),
    "json_object": ([True], [False, {"type": "object"}]),
    "regex": (["[0-9]{1,3}", "(yes|no)!"], ["(a", "", 7]),
    "choice": ([["yes", "no"], ["a \"quoted\" one", "back\\slash", "日本"]], [[], "yes", [1], [""]]),
    "grammar": (['root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'], ["root ::= ", "root ::= undefined_rule", ""]),
}


@pytest.mark.parametrize("name", BUILTINS["proposer"])
def test_builtin_proposer(name):
    from litellm_pipeline.demo import demo_checkpoint

    params = {"ngram": {"max_n": 3}, "tier": {"tier": "fast"}, "draft": {"model": str(demo_checkpoint())}}[name]
    check_proposer(name, **params)


@pytest.mark.parametrize("name", BUILTINS["constraint"])
def test_builtin_constraint(name):
    good, bad = CONSTRAINT_CASES[name]
    check_constraint(name, good, bad)


@pytest.mark.parametrize("name", BUILTINS["scheduler"])
def test_builtin_scheduler(name):
    preempted = check_scheduler(name)
    assert all(n > 0 for n in preempted.values()), preempted  # the tiny pools really forced preemption


@pytest.mark.parametrize("name", BUILTINS["telemetry"])
def test_builtin_telemetry(name):
    seen = check_telemetry_sink(name)
    assert {"rejected", "preempted", "evicted", "demoted", "promoted", "aborted", "costed", "step"} <= set(seen)


# The built-in stages are the default graph; each is also checked in its alternative configurations.
STAGE_CASES = [
    ("emit", {}),
    ("select_tier", {"mode": "deep"}),
    ("sample", {"sampler": "greedy"}),
    ("decode", {"attention": "sdpa", "layer_ops": "torch", "moe_dispatch": "packed"}),
]


def test_stage_cases_cover_every_builtin_stage():
    from litellm_pipeline.testing.stage import _default_order

    _, impls = _default_order(())
    assert sorted(impls.values()) == sorted(BUILTINS["stage"])  # the default graph holds every built-in stage


@pytest.mark.parametrize("name,params", STAGE_CASES, ids=[n for n, _ in STAGE_CASES])
def test_builtin_stages(name, params):
    got = check_stage(name, params, replace=name)
    assert got["order"] == ["admit", "select_tier", "route", "prefill", "decode", "sample", "emit"]
    assert got["preemptions"] > 0


def test_the_kit_leaves_no_registry_entry_behind():
    check_budget_solver(GreedySolver, random_cases=3)  # an object: registered under a throw-away name meanwhile
    assert not [n for kind in registry.KINDS for n in registry.names(kind) if n.startswith("_conformance")]


# -- broken implementations fail ----------------------------------------------------------------------------


def attention_without_causal_mask(q, k, v, k_cache, v_cache, meta, scale, sliding_window):
    """Prefill chunks attend over their whole context, future keys included."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = sdpa_paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    for s in meta.prefills:
        qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)
        ks, vs = k_cache[s.kv_slots].transpose(0, 1), v_cache[s.kv_slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
    return out


def attention_without_cache_writes(q, k, v, k_cache, v_cache, meta, scale, sliding_window):
    """Attends correctly on copies, but the step's K/V never reach the real cache."""
    return sdpa_paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale, sliding_window)


def test_broken_attention_fails():
    with pytest.raises(AssertionError, match=r"prefill-fresh-and-cached-mha .*differs from the float64 reference.*prefill chunk"):
        check_attention(attention_without_causal_mask, dtypes=[torch.float32])
    with pytest.raises(AssertionError, match=r"k_cache differs from 'old cache with the new K/V written"):
        check_attention(attention_without_cache_writes, dtypes=[torch.float32])


class SwappedSiluOps(TorchLayerOps):
    """silu applied to the up half instead of the gate half."""

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * F.silu(up)


class TopKWithoutTiesOps(TorchLayerOps):
    """Routes with torch.topk over reversed experts: equal scores go to the higher expert id."""

    def route(self, x, gate, native_k, normalize, plan):
        idx, w = super().route(x, gate, native_k, normalize, plan)
        if plan is None and native_k == 1:
            probs = F.softmax(self.linear(x, gate.flip(0)), dim=-1, dtype=torch.float32)
            w, rev = probs.topk(1)
            idx = gate.shape[0] - 1 - rev
        return idx, w


def test_broken_layer_ops_fail():
    with pytest.raises(AssertionError, match=r"SwappedSiluOps\.silu_mul \(torch\.float32\): differs"):
        check_layer_ops(SwappedSiluOps, engine=False)
    with pytest.raises(AssertionError, match=r"equal scores of experts 2 and 5 must pick 2 \(got experts \[(2, )?5\]\)"):
        check_layer_ops(TopKWithoutTiesOps, dtypes=[torch.float32], engine=False)


def dispatch_ignoring_weights(x, expert_idx, expert_w, w13, w2, ops):
    return packed_dispatch(x, expert_idx, torch.ones_like(expert_w), w13, w2, ops)


def test_broken_moe_dispatch_fails():
    with pytest.raises(AssertionError, match=r"dispatch_ignoring_weights \(1 tokens, top-1, torch.float32\): differs from the weighted sum"):
        check_moe_dispatch(dispatch_ignoring_weights, engine=False)


class IgnoresRemove(LRUPolicy):
    """Forgets to take back a block that a prefix hit reused: it can then evict a block in use."""

    def remove(self, block):
        pass


class LosesTrack(LRUPolicy):
    """Answers None from pop() every third time although blocks are evictable."""

    calls = 0

    def pop(self):
        LosesTrack.calls += 1
        return None if LosesTrack.calls % 3 == 0 else super().pop()


def test_broken_kv_policy_fails():
    with pytest.raises(AssertionError, match=r"IgnoresRemove: len\(\) is 3 after remove"):
        check_kv_policy(IgnoresRemove, engine=False)
    with pytest.raises(AssertionError, match=r"LosesTrack: pop\(\) returned None although blocks"):
        check_kv_policy(LosesTrack, engine=False)


class EvictsReusedBlocks:
    """Counts honestly, but remove() leaves the block in its eviction order: a block a prefix hit took back (in use)
    can still be chosen."""

    def __init__(self):
        self.order, self.live = [], set()

    def __len__(self):
        return len(self.live)

    def __contains__(self, block):
        return block in self.live

    def add(self, block):
        self.order.append(block)
        self.live.add(block)

    def remove(self, block):
        self.live.discard(block)

    def hit(self, block):
        pass

    def forget(self, block):
        pass

    def pop(self):
        if not self.live:
            return None
        block = self.order.pop(0)
        self.live.discard(block)
        return block


def test_policy_evicting_a_block_in_use_fails():
    with pytest.raises(AssertionError, match=r"EvictsReusedBlocks: pop\(\) chose block \d+, which is not evictable "
                                             r"\(in use by 1 request"):
        check_kv_policy(EvictsReusedBlocks, engine=False)


class IgnoresLimits:
    """The most valuable option everywhere, budget or not."""

    def solve(self, problem):
        choice = tuple(max(range(len(o)), key=lambda i: o[i].value) for o in problem.layers)
        return problem.evaluate(choice)


class MisreportsCosts(GreedySolver):
    def solve(self, problem):
        s = super().solve(problem)
        return None if s is None else Solution(s.choice, tuple(c * 0.5 for c in s.costs), s.value)


class GivesUpEarly(GreedySolver):
    """None whenever the problem has more than two layers."""

    def solve(self, problem):
        return None if len(problem.layers) > 2 else super().solve(problem)


def test_broken_budget_solvers_fail():
    with pytest.raises(AssertionError, match=r"IgnoresLimits on greedy trap .*over the limits"):
        check_budget_solver(IgnoresLimits, engine=False)
    with pytest.raises(AssertionError, match=r"MisreportsCosts on .*reports costs"):
        check_budget_solver(MisreportsCosts, engine=False)
    with pytest.raises(AssertionError, match=r"GivesUpEarly on .*returned None although"):
        check_budget_solver(GivesUpEarly, engine=False)
    with pytest.raises(AssertionError, match=r"greedy on greedy trap.*below the optimum 2\.8"):
        check_budget_solver("greedy", optimal=True, engine=False)  # greedy is not optimal, and says exact=True


class IgnoresAllowedExperts(TierSetRouter):
    """Keeps the expert counts but drops the restriction to a TierSet's experts."""

    def _allowed(self, schedule):
        return None


class NativeEverywhere(TierSetRouter):
    """The checkpoint's own top-k for every token, whatever the tier asks."""

    def plan(self, schedule):
        t = sum(n for _, n in schedule)
        return RoutePlan(top_k=torch.full((t,), self.native_k), max_k=self.native_k)


class BatchMinimum(TierSetRouter):
    """Every token gets the smallest count in the batch: within every limit, but it depends on the neighbours."""

    def plan(self, schedule):
        k = min(min(r.tierset.experts_per_layer) for r, _ in schedule)
        return RoutePlan(max_k=k, allowed=self._allowed(schedule))


def test_broken_routers_fail():
    with pytest.raises(AssertionError, match=r"IgnoresAllowedExperts, schedule .*tier 'narrow.*experts \[.*\] are "
                                             r"allowed, outside its TierSet's allowed_experts"):
        check_router(IgnoresAllowedExperts, engine=False)
    with pytest.raises(AssertionError, match=r"NativeEverywhere, schedule .*tier '(fast|k1|layered|narrow_layered)'.* "
                                             r"a token gets 2 experts, its TierSet allows 1"):
        check_router(NativeEverywhere, engine=False)
    with pytest.raises(AssertionError, match=r"BatchMinimum, schedule .* other limits in this batch than alone"):
        check_router(BatchMinimum, engine=False)


class GlobalRngSampler(Sampler):
    """Draws from torch's global generator instead of each row's own."""

    def __call__(self, logits, rows):
        probs = (logits.float() / max(rows[0].params.temperature, 1e-5)).softmax(-1)
        if all(r.params.greedy for r in rows):
            return super().__call__(logits, rows)
        return SamplerOutput(torch.multinomial(probs, 1).flatten().tolist(), [None] * len(rows))


class NoTopKSampler(Sampler):
    def __call__(self, logits, rows):
        for r in rows:
            r.params = r.params.model_copy(update={"top_k": 0})  # 0: no top-k
        return super().__call__(logits, rows)


def test_broken_samplers_fail():
    with pytest.raises(AssertionError, match=r"GlobalRngSampler: top_k=3 allows tokens|changed torch's global RNG"):
        check_sampler(GlobalRngSampler)
    with pytest.raises(AssertionError, match=r"NoTopKSampler: top_k=3 allows tokens \[.*\], seed \d+ drew"):
        check_sampler(NoTopKSampler)
    with pytest.raises(AssertionError, match="it does not sample"):
        check_sampler("greedy")  # a sampler that ignores temperature is told so unless stochastic=False


class FailsOnThirdToken(Stage):
    level = "step"
    inputs = ("samples",)
    outputs = ("samples",)

    def __call__(self, ctx):
        if any(len(s.request.output_ids) >= 2 for s in ctx.samples):
            raise RuntimeError("boom on the third token")


class ShoutsDeltas(Stage):
    """Changes the streamed delta but not the request's text: the stream and the final text disagree."""

    level = "step"
    inputs = ("emissions",)
    outputs = ("emissions",)

    def __call__(self, ctx):
        ctx.emissions = [e._replace(delta_text=e.delta_text + "!") for e in ctx.emissions]


def test_broken_stages_fail():
    with pytest.raises(AssertionError, match=r"FailsOnThirdToken in \[.*'sample', 'checked', 'emit'\]: request .* "
                                             r"finished with 'error'.*boom on the third token"):
        check_stage(FailsOnThirdToken)
    with pytest.raises(AssertionError, match=r"ShoutsDeltas .*streamed '.*!' but its final text is"):
        check_stage(ShoutsDeltas)


class OverfullScheduler(FcfsScheduler):
    """Hands out four times the configured token budget per step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_batched_tokens *= 4


def test_broken_scheduler_fails():
    with pytest.raises(AssertionError, match=r"OverfullScheduler: a step of \d+ tokens \(max_num_batched_tokens 16\)"):
        check_scheduler(OverfullScheduler)


class FinishedHater(MemorySink):
    def publish(self, event):
        if event.kind == "finished":
            raise KeyError(event.reason)
        super().publish(event)


def test_broken_telemetry_sink_fails():
    with pytest.raises(AssertionError, match=r"FinishedHater: publish\(RequestFinished\(.*\) raised KeyError"):
        check_telemetry_sink(FinishedHater)
