"""Tensor and expert parallelism on torch.distributed (gloo, 2 ranks on this machine's CPU).

Every family gives one process's greedy tokens under ``parallel.tensor=2`` and every MoE family under
``parallel.expert=2`` (logprobs within 1e-5); the batch-invariant mode keeps its guarantee; KV copies between the hot
and warm pools reach the workers; ``close()`` and ``with`` leave no process behind, and a dead or hung rank becomes
an error naming it.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hf_models import ARCHS, random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.request_spec import RequestSpec

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
PROMPTS = random_prompts([5, 17, 30], seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.fixture(autouse=True)
def _restore_threads():
    """A parallel engine shares the cores out between its ranks (the driver takes its share): put them back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run(path, overrides=(), prompts=PROMPTS, params=GREEDY):
    with LLM(model=str(path), overrides=list(overrides)) as llm:
        outs = llm.generate(prompts, params)
        return [(o.token_ids, o.logprobs, o.error) for o in outs], llm


def _assert_same(one, par):
    for (tok1, lp1, _), (tok2, lp2, err) in zip(one, par):
        assert err is None
        assert tok2 == tok1
        for a, b in zip(lp1, lp2):
            assert a.keys() == b.keys()
            # float32 sums in another order: within 1e-5, relative to the logprob's size (these checkpoints' logits
            # are scaled up so that greedy choices have clear gaps: logprobs of -20 and below are common)
            assert all(abs(a[t] - b[t]) <= 1e-5 * max(1.0, abs(a[t])) for t in a), (a, b)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.rt.parallel.driver.procs]


def _split_matches_one_process(path, split: str):
    """The split engine (closed) after checking its tokens and logprobs against one process's."""
    one, _ = _run(path)
    par, llm = _run(path, [split])
    _assert_same(one, par)
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_matches_one_process(hf_checkpoint, arch):
    llm = _split_matches_one_process(hf_checkpoint(arch), "parallel.tensor=2")
    model = llm.engine.rt.model
    attn = model.layers[0].self_attn
    assert model.embed_tokens.shape[0] == 384 // 2  # the vocabulary split
    assert attn.num_heads == 2 and attn.num_kv_heads == max(1, model.cfg.num_kv_heads // 2)  # qwen3: 1 KV head
    assert llm.engine.rt.kv_caches[0][0].shape[1] == attn.num_kv_heads


@pytest.mark.parametrize("arch", MOE)
def test_expert_parallel_matches_one_process(hf_checkpoint, arch):
    llm = _split_matches_one_process(hf_checkpoint(arch), "parallel.expert=2")
    moe = llm.engine.rt.model.layers[0].mlp
    assert moe.experts == (0, 2) and moe.w13.shape[0] == 2  # rank 0 holds experts 0 and 1 of 4
    assert llm.engine.rt.model.layers[0].self_attn.num_heads == 4  # attention whole on every rank


def test_tensor_and_expert_parallel_together_with_tiers(hf_checkpoint):
    """tensor=2 expert=2 on one pair of ranks (attention and the shared expert split, routed experts spread); the
    tier's expert limits are decided once on the driver and reach the workers with the step."""
    path = hf_checkpoint("qwen2_moe")
    specs = [RequestSpec(prompt=p, params=GREEDY, tier=t) for p, t in zip(PROMPTS, ("fast", "balanced", "max"))]
    one, _ = _run(path, prompts=specs)
    par, llm = _run(path, ["parallel.tensor=2", "parallel.expert=2"], prompts=specs)
    _assert_same(one, par)
    assert llm.engine.rt.model.layers[0].mlp.shared_expert.down_proj.shape[1] == 48 // 2


def test_batch_invariance_holds_under_tensor_parallelism(hf_checkpoint):
    path = hf_checkpoint("mixtral")
    target = RequestSpec(prompt=PROMPTS[1], params=GREEDY)
    others = [RequestSpec(prompt=p, params=GREEDY) for p in random_prompts([3, 40, 22, 9], seed=3)]
    with LLM(model=str(path), overrides=["parallel.tensor=2", "engine.deterministic=true",
                                         "engine.max_num_batched_tokens=32"]) as llm:
        alone = llm.generate(target)[0]
        batched = llm.generate([others[0], target, *others[1:]])[1]
    assert (batched.token_ids, batched.logprobs) == (alone.token_ids, alone.logprobs)


def test_warm_pool_copies_reach_the_workers(hf_checkpoint):
    """A hot pool too small for the shared prefixes: blocks are demoted to the warm pool and promoted back; the
    workers' caches follow (else their K/V would differ from the driver's and the tokens would too)."""
    path = hf_checkpoint("llama")
    base = random_prompts([48], seed=11)[0]
    prompts = [base + p for p in random_prompts([4, 6, 5, 7], seed=12)]
    small = ["cache.num_blocks=10", "cache.block_size=8", "cache.warm_blocks=32", "engine.max_num_seqs=1"]
    one, _ = _run(path, small, prompts=prompts)
    one2, _ = _run(path, small, prompts=prompts[::-1])
    with LLM(model=str(path), overrides=["parallel.tensor=2", *small]) as llm:
        par = [(o.token_ids, o.logprobs, o.error) for o in llm.generate(prompts, GREEDY)]
        par2 = [(o.token_ids, o.logprobs, o.error) for o in llm.generate(prompts[::-1], GREEDY)]
        assert llm.engine.rt.parallel.driver.copies > 0
        assert any(o.num_cached_tokens for o in llm.generate(prompts[:1], GREEDY))
    _assert_same(one, par)
    _assert_same(one2, par2)


def test_close_and_with_leave_no_process(hf_checkpoint):
    path = hf_checkpoint("llama")
    llm = LLM(model=str(path), overrides=["parallel.tensor=2"])
    pids = _worker_pids(llm)
    assert pids and all(_alive(p) for p in pids)
    llm.close()
    assert not any(_alive(p) for p in pids)
    llm.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        out.raise_error()
    with LLM(model=str(path), overrides=["parallel.tensor=2"]) as llm2:
        pids = _worker_pids(llm2)
    assert not any(_alive(p) for p in pids)
    dropped = LLM(model=str(path), overrides=["parallel.tensor=2"])  # never closed: dropping it stops its workers
    pids = _worker_pids(dropped)
    assert dropped.generate(PROMPTS[0], GREEDY)[0].error is None
    del dropped
    gc.collect()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_a_dead_rank_is_an_error_naming_it(hf_checkpoint):
    path = hf_checkpoint("llama")
    with LLM(model=str(path), overrides=["parallel.tensor=2", "parallel.timeout_s=30"]) as llm:
        (pid,) = _worker_pids(llm)
        assert llm.generate(PROMPTS[0], GREEDY)[0].error is None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.finish_reason == "error" and "rank 1" in out.error and "signal 9" in out.error
        assert time.monotonic() - t0 < 25  # not the collective timeout: the peer's closed connection
        again = llm.generate(PROMPTS[1], GREEDY)[0]  # every later call fails at once, naming it
        assert again.finish_reason == "error" and "rank 1" in again.error


def test_a_hung_rank_is_an_error_after_the_timeout(hf_checkpoint):
    path = hf_checkpoint("llama")
    llm = LLM(model=str(path), overrides=["parallel.tensor=2", "parallel.timeout_s=3"])
    (pid,) = _worker_pids(llm)
    try:
        os.kill(pid, signal.SIGSTOP)
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.finish_reason == "error"
        assert "rank(s) [1] did not answer within parallel.timeout_s=3" in out.error
    finally:
        llm.close()  # kills the stopped worker
    assert not _alive(pid)


def test_the_driver_killed_or_terminated_takes_its_workers_along(hf_checkpoint, tmp_path):
    """SIGTERM (no handler: the default action) and SIGKILL on the driver: the workers see it go and exit."""
    path = hf_checkpoint("llama")
    script = tmp_path / "drive.py"
    script.write_text(
        "import sys, time\nfrom litellm_pipeline import LLM\n"
        f"llm = LLM(model={str(path)!r}, overrides=['parallel.tensor=2'])\n"
        "print(*[p.pid for p in llm.engine.rt.parallel.driver.procs], flush=True)\ntime.sleep(120)\n"
    )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        (pid,) = map(int, proc.stdout.readline().split())
        assert _alive(pid)
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"worker outlived its driver after {sig!r}"


def test_a_worker_that_cannot_start_is_named():
    """What a worker reports on its start pipe when its build fails becomes the driver's error, naming the rank."""
    from litellm_pipeline.parallel.workers import Driver, ParallelError, _Proc

    r, w = os.pipe()
    os.write(w, b"CheckpointError: shard unreadable\n")
    os.close(w)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    driver = Driver(2, [_Proc(sleeper, r)], None, 5.0)
    driver.start_deadline = time.monotonic() + 5
    try:
        with pytest.raises(ParallelError, match="rank 1 failed to start: CheckpointError: shard unreadable"):
            driver.wait_ready()
    finally:
        driver.close()
    assert sleeper.poll() is not None


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.tensor=2", "parallel.expert=4"], "tensor=2 with expert=4 is not supported"),
    (["parallel.expert=2"], "the model is dense"),
    (["parallel.tensor=3"], "must divide the model's 4 attention heads"),
    (["parallel.tensor=2", "device.compile=true"], "device.compile"),
    (["parallel.tensor=2", "parallel.backend=nccl"], "needs device.type=cuda"),
])
def test_unsupported_splits_are_config_errors(hf_checkpoint, overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(hf_checkpoint("llama")), overrides=overrides)


def test_a_model_too_big_for_one_rank_runs_on_two(hf_checkpoint):
    """device.memory_gb caps one rank's weights: the tiny llama (about 0.3 MiB of float32 weights) does not fit
    0.2 MiB alone, and does under tensor=2."""
    path = hf_checkpoint("llama")
    cap = f"device.memory_gb={0.2 / 1024}"
    with pytest.raises(ConfigError, match=r"device.memory_gb=.*: the model's weights take .* GiB per rank"):
        LLM(model=str(path), overrides=[cap])
    one, _ = _run(path)
    par, _ = _run(path, [cap, "parallel.tensor=2"])
    _assert_same(one, par)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (.ci/gpu_check.sh)")
def test_tensor_parallel_on_cuda(hf_checkpoint):
    """On the GPU machine: NCCL where there is a GPU per rank, else gloo with both ranks on the one GPU."""
    path = hf_checkpoint("mixtral")
    one, _ = _run(path, ["device=cuda"])
    par, llm = _run(path, ["device=cuda", "parallel.tensor=2"])
    _assert_same(one, par)
    assert llm.engine.rt.kv_caches[0][0].is_cuda


def test_torchrun_ranks_run_the_same_command(hf_checkpoint, tmp_path):
    """``torchrun ... -m litellm_pipeline +recipe=generate parallel.tensor=2``: rank 0 runs the recipe, rank 1 serves
    its shard (rank and world from the environment); the text is one process's, and both ranks exit."""
    path = hf_checkpoint("qwen2")
    args = ["-m", "litellm_pipeline", "+recipe=generate", f"model.path={path}", "prompt=hello world",
            "sampling.max_tokens=12", "sampling.ignore_eos=true"]
    one = subprocess.run([sys.executable, *args, f"hydra.run.dir={tmp_path / 'one'}"], capture_output=True, text=True,
                         timeout=120)
    assert one.returncode == 0, one.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args,
                          "parallel.tensor=2", f"hydra.run.dir={tmp_path / 'two'}"], capture_output=True, text=True,
                         timeout=180, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    def text(out: str) -> list[str]:  # the prompt and the completion (the summary line has timings)
        return [line for line in out.splitlines() if line.strip() and not line.startswith("[summary]")]

    assert len(text(one.stdout)) >= 3 and text(two.stdout) == text(one.stdout)


def test_two_parallel_engines_live_in_one_process(hf_checkpoint):
    """Each engine has its own groups (not torch.distributed's default one): a tensor- and an expert-parallel engine
    side by side, stepping in turns."""
    path = hf_checkpoint("mixtral")
    one, _ = _run(path)
    with LLM(model=str(path), overrides=["parallel.tensor=2"]) as a, \
            LLM(model=str(path), overrides=["parallel.expert=2"]) as b:
        for llm in (a, b, a):
            _assert_same(one, [(o.token_ids, o.logprobs, o.error) for o in llm.generate(PROMPTS, GREEDY)])


def test_the_bench_section_counts_the_collectives_of_each_split(hf_checkpoint):
    """bench.parallel: one process, tensor=2 and expert=2 on a 2-layer MoE model; tensor=2 runs 6 collectives a step
    (the embedding, attention and MoE block of 2 layers, the LM head's gather), expert=2 two (the MoE blocks)."""
    from litellm_pipeline.bench.parallel import measure_parallel
    from litellm_pipeline.bench.report import parallel_table
    from litellm_pipeline.config.build import build_engine
    from litellm_pipeline.config.compose import compose

    path = hf_checkpoint("mixtral")

    def build(p, extra):
        return build_engine(compose([f"model.path={p}", *(f"{k}={v}" for k, v in extra.items())]))

    got = measure_parallel(build, path, {"vocab_size": 384, "num_local_experts": 4}, "tiny", [1], 2, 8, 4, 1, 0)
    rows = {r["split"]: r for r in got["rows"]}
    assert set(rows) == {"1 rank", "tensor=2", "expert=2"} and all(r["same"] for r in rows.values())
    assert rows["tensor=2"]["collectives_per_step"] == 6 and rows["expert=2"]["collectives_per_step"] == 2
    assert rows["tensor=2"]["collective_ms_per_step"] > 0 and rows["1 rank"]["steps"] == 0
    assert "tensor=2" in "\n".join(parallel_table([got]))


@pytest.mark.parametrize("method", ["tier", "draft"])
def test_speculative_decoding_under_tensor_parallelism(hf_checkpoint, method):
    """Drafts from a cheaper tier of the split model (its forwards reach the workers) or from a separate draft model
    on the driver alone; verification through the split model keeps one process's greedy tokens."""
    path = hf_checkpoint("mixtral")
    one, _ = _run(path)
    spec = [f"speculative={method}", "speculative.adaptive=false", "speculative.disable_by_batch_size=null"]
    if method == "draft":
        spec.append(f"speculative.model={hf_checkpoint('mixtral', seed=1)}")
    with LLM(model=str(path), overrides=["parallel.tensor=2", *spec]) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    for (tok1, _, _), out in zip(one, outs):
        assert out.error is None and out.token_ids == tok1
    assert sum(o.num_draft_tokens for o in outs) > 0


def test_a_driver_failure_mid_call_breaks_the_engine_at_once(hf_checkpoint):
    """The driver's own part of a step raises after the workers were sent it (their collectives would wait for the
    driver's): the engine is broken with the driver's error, the worker is stopped now, nobody waits for a timeout."""
    path = hf_checkpoint("llama")
    with LLM(model=str(path), overrides=["parallel.tensor=2", "parallel.timeout_s=60"]) as llm:
        (pid,) = _worker_pids(llm)
        attn = llm.engine.rt.model.layers[1].self_attn
        real = attn.attn_fn

        def broken(*args, **kwargs):
            attn.attn_fn = real
            raise MemoryError("no room for the scores")

        attn.attn_fn = broken
        t0 = time.monotonic()
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert time.monotonic() - t0 < 30
        assert out.finish_reason == "error" and "MemoryError: no room for the scores" in out.error
        assert "rank 0 failed in the middle of a model call: MemoryError" in llm.engine.failure
        assert not _alive(pid)
        assert "rank 0 failed" in llm.generate(PROMPTS[1], GREEDY)[0].error


def test_the_shared_region_leaves_nothing_in_dev_shm(hf_checkpoint):
    with LLM(model=str(hf_checkpoint("llama")), overrides=["parallel.tensor=2"]) as llm:
        region = llm.engine.rt.parallel.driver.region
        assert region is not None and not os.path.exists(region.path)  # unlinked once every rank mapped it
        assert llm.generate(PROMPTS[0], GREEDY)[0].error is None


def test_calibrate_refuses_a_split_engine():
    from litellm_pipeline.config.compose import compose
    from litellm_pipeline.tasks.calibrate import run

    with pytest.raises(ConfigError, match="calibrate: measures one process"):
        run(compose(["+recipe=calibrate", "parallel.expert=2"]))
