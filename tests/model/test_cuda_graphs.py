"""Decode CUDA graphs: bucketing, padding into the scratch slot and the static copies, checked on a CPU with a
backend that replays by calling the captured forward again on the same static tensors; on a GPU (skipped without
one) the real capture must give the eager tokens."""

from __future__ import annotations

import pytest
import torch

from litellm_pipeline import SamplingParams
from litellm_pipeline.model.cuda_graphs import (
    batch_buckets,
    context_buckets,
    decode_graphs,
)
from litellm_pipeline.testing._support import DEMO_PROMPTS, assert_drained, build_llm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True)


class ReplayBackend:
    """A graph that is the function itself: replay recomputes into the captured output tensor."""

    def __init__(self):
        self.captures = 0

    def capture(self, fn):
        self.captures += 1
        out = fn()
        return (lambda: out.copy_(fn())), out


class FailingBackend:
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def _decode_stage(llm):
    return next(s for s in llm.engine.step_stages if type(s).__name__ == "Decode")


def with_graphs(overrides=(), backend=None):
    llm = build_llm(list(overrides))
    stage = _decode_stage(llm)
    stage.graphs = decode_graphs(llm.engine.rt, backend or ReplayBackend())
    return llm, stage.graphs


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert context_buckets(64, 16) == [64]
    assert context_buckets(300, 16) == [64, 128, 256, 304]  # the last holds max_model_len in whole blocks
    assert context_buckets(100, 48) == [96, 144]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_replayed_decode_steps_give_the_eager_tokens(params):
    want = [o.token_ids for o in build_llm().generate(list(DEMO_PROMPTS), params)]
    llm, graphs = with_graphs()
    got = [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), params)]
    assert got == want
    assert graphs.replays >= 10 and (8, 64) in graphs.buckets  # 6 requests padded to the batch bucket 8
    assert_drained(llm, "cuda graphs")


def test_padding_rows_write_the_scratch_block_past_the_pool():
    llm, graphs = with_graphs()
    rt = llm.engine.rt
    scratch = graphs.scratch
    assert scratch == rt.pool.num_blocks * rt.block_size < rt.kv_caches[0][0].shape[0]
    llm.generate(["12+345=", "copy:hello=", "rev:abc="], GREEDY)  # three are padded to 4
    assert any(key[0] == 4 for key in graphs.buckets)
    assert all((k[scratch] != 0).any() for k, _ in rt.kv_caches), "padding rows wrote no K to the scratch slot"
    assert all((k[scratch + 1 :] == 0).all() for k, _ in rt.kv_caches)


def test_prefix_cache_hits_after_padded_steps_stay_exact():
    want = [o.token_ids for o in build_llm().generate(list(DEMO_PROMPTS), GREEDY)]
    llm, graphs = with_graphs(["cache.block_size=4"])
    first = [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), GREEDY)]
    again = [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), GREEDY)]  # prompts now come from the cache
    assert first == again == want and graphs.replays > 0
    assert_drained(llm, "cuda graphs, prefix hits")


def test_mixed_tier_steps_run_eagerly():
    llm, graphs = with_graphs()
    llm.generate(list(DEMO_PROMPTS[:2]), GREEDY, tier="fast")  # a route plan on every step
    assert graphs.replays == 0 and not graphs.buckets


def test_a_failed_capture_turns_graphs_off_and_runs_eagerly():
    want = [o.token_ids for o in build_llm().generate(list(DEMO_PROMPTS), GREEDY)]
    llm, graphs = with_graphs(backend=FailingBackend())
    with pytest.warns(RuntimeWarning, match="CUDA graphs turned off: .*stream is capturing"):
        got = [o.token_ids for o in llm.generate(list(DEMO_PROMPTS), GREEDY)]
    assert got == want and not graphs.enabled and graphs.replays == 0


def test_offloaded_experts_never_replay():
    llm, graphs = with_graphs(["moe.hot_experts=4"])
    llm.generate(list(DEMO_PROMPTS[:2]), GREEDY)
    assert not graphs.enabled and graphs.replays == 0


def test_graphs_are_off_on_a_cpu_device():
    assert _decode_stage(build_llm()).graphs is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_cuda_graph_decode_gives_the_eager_tokens_on_a_gpu(arch, hf_checkpoint):
    from litellm_pipeline import LLM

    path = str(hf_checkpoint(arch))
    prompts = [[5, 6, 7, 8, 9], [10, 20, 30], [3, 1, 4, 1, 5, 9, 2, 6]]
    eager = LLM(model=path, device="cuda", dtype="float32", overrides=["device.cuda_graphs=false"])
    graphs = LLM(model=path, device="cuda", dtype="float32")
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.token_ids for o in graphs.generate(prompts, GREEDY)] == want
    runner = _decode_stage(graphs).graphs
    assert runner is not None and (runner.replays > 0 or runner.error is not None), runner.error


@pytest.mark.slow
def test_torch_compile_gives_the_eager_tokens():
    """device.compile: the forward through torch.compile (inductor's C++ backend here) matches eager greedy."""
    prompts = list(DEMO_PROMPTS[:3])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in build_llm().generate(prompts, params)]
    llm = build_llm(["device.compile=true"])
    assert hasattr(llm.engine.rt.model.forward, "_torchdynamo_orig_callable") or "compile" in repr(
        llm.engine.rt.model.forward).lower()
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
