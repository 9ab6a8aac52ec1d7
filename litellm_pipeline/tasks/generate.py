"""``+recipe=generate``: complete the prompt (or the demo prompts) and print each text with a summary line."""

from __future__ import annotations

import time

from litellm_pipeline.config.build import build_engine
from litellm_pipeline.tasks import app_config, output_dir

# generate's prompts for a user checkpoint given without a prompt (the demo model has its own)
DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "1 2 3 4 5")


def run(cfg) -> list:
    """Generate for the prompt (or the demo prompts), print each text and one summary line per prompt.

    A prompt written in one of the demo skills' formats (``12+345=``, ``rev:abc=`` ...) is also checked: the
    answer is marked ✓, or ✗ with the expected answer.
    """
    from litellm_pipeline.demo import demo_prompts, solve

    params = app_config(cfg).sampling_params()
    engine = build_engine(cfg)
    demo = cfg.model.path is None
    if cfg.prompt is not None:
        prompts = [cfg.prompt]
    elif demo:
        prompts = [ex.prompt for ex in demo_prompts(cfg.model.demo_seed)]
    else:
        prompts = list(DEFAULT_PROMPTS)
    checks = [solve(p) for p in prompts]  # (the demo chat template makes the prompt the user message)
    tok = engine.tokenizer
    if cfg.chat:  # the template writes the special tokens it wants: none are added again (as transformers does)
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    inputs = [tok.encode(p, add_special_tokens=False) if cfg.chat else p for p in prompts]
    label = (
        "embedded demo MoE (trained demo model: 4 layers, 8 experts, top-2; skills add, reverse, sort, copy, "
        "recall; prompts held out from training)"
        if demo
        else str(cfg.model.path)
    )
    print(f"model: {label}")
    t0 = time.perf_counter()
    results = engine.run([engine.add_request(p, params) for p in inputs])
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
    from litellm_pipeline.telemetry.prometheus import PrometheusSink

    sink = engine.bus.sink(PrometheusSink)
    if sink is not None:
        print(f"\nmetrics (Prometheus text format): {sink.write(output_dir() / 'metrics.prom')}")
