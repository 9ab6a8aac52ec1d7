"""Tasks a recipe can run (``task: NAME``); each takes the composed config."""

from __future__ import annotations

import time
from typing import Callable

from omegaconf import DictConfig

from litellm_pipeline.builder import build_engine
from litellm_pipeline.errors import ConfigError

# generate's prompts for a user checkpoint given without a prompt (the demo model has its own)
DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "1 2 3 4 5")

TASKS: dict[str, Callable[[DictConfig], object]] = {}


def task(name: str):
    def deco(fn):
        TASKS[name] = fn
        return fn

    return deco


def run_task(cfg: DictConfig) -> object:
    name = cfg.get("task")
    if name is None:
        raise ConfigError("no task chosen: run a recipe, e.g. `python -m litellm_pipeline +recipe=generate`")
    if name not in TASKS:
        raise ConfigError(f"task: unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](cfg)


@task("generate")
def generate(cfg: DictConfig) -> list:
    """Generate for the prompt (or the demo prompts), print each text and one summary line per prompt.

    A prompt written in one of the demo skills' formats (``12+345=``, ``rev:abc=`` ...) is also checked: the
    answer is marked ✓, or ✗ with the expected answer.
    """
    from litellm_pipeline.builder import to_plain
    from litellm_pipeline.config_schema import validate_config
    from litellm_pipeline.demo import demo_prompts, solve

    params = validate_config(to_plain(cfg)).sampling_params()
    engine = build_engine(cfg)
    demo = cfg.model.path is None
    if cfg.prompt is not None:
        prompts = [cfg.prompt]
    elif demo:
        prompts = [ex.prompt for ex in demo_prompts(cfg.model.demo_seed)]
    else:
        prompts = list(DEFAULT_PROMPTS)
    checks = [None if cfg.chat else solve(p) for p in prompts]
    if cfg.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    label = (
        "embedded demo MoE (trained demo model: 4 layers, 8 experts, top-2; skills add, reverse, sort, copy, "
        "recall; prompts held out from training)"
        if demo
        else str(cfg.model.path)
    )
    print(f"model: {label}")
    t0 = time.perf_counter()
    results = engine.run([engine.add_request(p, params) for p in prompts])
    elapsed = time.perf_counter() - t0
    total_out = sum(len(o.token_ids) for o in results)
    for prompt, r, check in zip(prompts, results, checks):
        verdict = ""
        if check is not None:
            verdict = "   ✓" if r.text == check[1] else f"   ✗ (expected {check[1]})"
        print(f"\n>>> {prompt}\n{r.text}{verdict}")
        cost = f" cost={r.cost.monetary:.4g}" if r.cost is not None else ""
        print(
            f"[summary] prompt_tokens={len(r.prompt_token_ids)} output_tokens={len(r.token_ids)} "
            f"finish={r.finish_reason} tier={r.tier}{cost} tokens/s={total_out / elapsed:.1f} (batch of {len(results)})"
        )
    write_metrics(engine)
    return results


def write_metrics(engine) -> None:
    """With ``telemetry=prometheus``: the run's metrics in the Prometheus text format, in the run's folder."""
    from litellm_pipeline.demo import output_dir
    from litellm_pipeline.telemetry.prometheus import PrometheusSink

    sink = engine.bus.sink(PrometheusSink)
    if sink is not None:
        print(f"\nmetrics (Prometheus text format): {sink.write(output_dir() / 'metrics.prom')}")


@task("serve")
def serve(cfg: DictConfig) -> None:
    """The OpenAI-compatible HTTP server (see litellm_pipeline.server); runs until SIGTERM/SIGINT drains it."""
    from litellm_pipeline.builder import to_plain
    from litellm_pipeline.config_schema import validate_config
    from litellm_pipeline.server.serve import serve as run_server

    run_server(validate_config(to_plain(cfg)))


@task("bench")
def bench(cfg: DictConfig) -> dict:
    """Benchmark the engine against transformers and this machine's roofline (see litellm_pipeline.bench)."""
    from litellm_pipeline.bench import run_bench

    return run_bench(cfg)


@task("train_demo")
def train_demo(cfg: DictConfig) -> dict:
    """Train the demo MoE on the skills corpus and write a Hugging Face checkpoint (see litellm_pipeline.demo)."""
    from litellm_pipeline.demo.train import run_training

    return run_training(cfg)


@task("eval")
def evaluate(cfg: DictConfig) -> dict:
    """Exact-match accuracy per task and tier on held-out skills prompts; prints a table, writes eval.json."""
    from litellm_pipeline.demo.evaluate import run_eval

    return run_eval(cfg)


@task("calibrate")
def calibrate(cfg: DictConfig) -> dict:
    """Measure the budget solvers' cost and quality model on this model and machine; writes the profile."""
    from litellm_pipeline.tiers.calibrate import run_calibrate

    return run_calibrate(cfg)


@task("sweep")
def sweep(cfg: DictConfig) -> dict:
    """One job of a tier / budget sweep: the workload's quality, latency, money and compliance (sweep.json)."""
    from litellm_pipeline.sweep import run_sweep_job

    return run_sweep_job(cfg)


@task("report")
def report(cfg: DictConfig) -> dict:
    """A Markdown table and a Pareto plot of a sweep directory's sweep.json files."""
    from litellm_pipeline.report import run_report

    return run_report(cfg)


@task("budget_load")
def budget_load(cfg: DictConfig) -> dict:
    """Cost-adaptive routing under overload: TierSets chosen over time and budget compliance per class."""
    from litellm_pipeline.budget_load import run_budget_load

    return run_budget_load(cfg)


@task("faults")
def faults(cfg: DictConfig) -> dict:
    """The randomized fault suite (see litellm_pipeline.fault_suite); exits 1 if an invariant broke."""
    import json
    import sys

    from litellm_pipeline.builder import to_plain
    from litellm_pipeline.demo import output_dir
    from litellm_pipeline.fault_suite import fault_settings, run_fault_suite

    plain = to_plain(cfg)
    result = run_fault_suite(fault_settings(plain.get("faults")), plain["model"].get("path"))
    path = output_dir() / "faults.json"
    path.write_text(json.dumps(result, indent=2))
    print(
        f"{result['runs']} runs (seed {result['seed']}): {result['admitted']} requests admitted, {result['invalid']} "
        f"invalid submissions refused, {result['aborted']} aborted, {result['faulted']} faulted, "
        f"{result['session_turns']} session turns, {result['preemptions']} preemptions, {result['steps']} steps, "
        f"{result['seconds']:.0f} s; {len(result['failures'])} invariant violations; wrote {path}"
    )
    if result["failures"]:
        sys.exit(1)
    return result


@task("loadtest")
def loadtest(cfg: DictConfig) -> dict:
    """The HTTP server under a streaming Poisson load vs the same load in-process (see litellm_pipeline.loadtest)."""
    from hydra.core.hydra_config import HydraConfig

    from litellm_pipeline.loadtest import run_loadtest

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return run_loadtest(cfg, overrides)


@task("plugins")
def plugins(cfg: DictConfig) -> dict:
    """Every registered implementation per kind with its origin and one-line doc, plugins' config options, and
    the plugins that failed to load or were skipped (see litellm_pipeline.plugin_listing). Loads no model."""
    from litellm_pipeline.builder import to_plain
    from litellm_pipeline.config_schema import validate_config
    from litellm_pipeline.plugin_listing import run_listing

    section = validate_config(to_plain(cfg)).plugins
    return run_listing(section.allow, section.deny)


@task("new_plugin")
def new_plugin(cfg: DictConfig) -> object:
    """Write a ready plugin package for one registry kind (see litellm_pipeline.scaffold). Loads no model."""
    from omegaconf import OmegaConf

    from litellm_pipeline.scaffold import run_new_plugin

    section = cfg.get("plugin")
    if section is not None:
        missing = [k for k in ("name", "kind") if OmegaConf.is_missing(section, k)]
        if missing:
            raise ConfigError("; ".join(f"plugin.{k}: required (plugin.{k}=...)" for k in missing))
        section = OmegaConf.to_container(section, resolve=True)
    return run_new_plugin(section)
