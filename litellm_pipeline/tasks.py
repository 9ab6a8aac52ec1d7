"""Tasks a recipe can run (``task: NAME``); each takes the composed config."""

from __future__ import annotations

import time
from typing import Callable

from omegaconf import DictConfig

from litellm_pipeline.builder import build_engine
from litellm_pipeline.demo_model import DEMO_PROMPTS
from litellm_pipeline.errors import ConfigError

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
    """Generate for the prompt (or the demo prompts), print each text and one summary line per prompt."""
    from litellm_pipeline.config_schema import validate_config
    from litellm_pipeline.builder import to_plain

    params = validate_config(to_plain(cfg)).sampling_params()
    engine = build_engine(cfg)
    demo = cfg.model.path is None
    prompts = [cfg.prompt] if cfg.prompt is not None else list(DEMO_PROMPTS)
    if cfg.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    label = "embedded demo MoE (RANDOM weights: the text is noise)" if demo else str(cfg.model.path)
    print(f"model: {label}")
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while len(outs) < len(reqs):
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    elapsed = time.perf_counter() - t0
    results = [outs[r.request_id] for r in reqs]
    total_out = sum(len(o.token_ids) for o in results)
    for prompt, r in zip(prompts, results):
        print(f"\n>>> {prompt}\n{r.text}")
        print(
            f"[summary] prompt_tokens={len(r.prompt_token_ids)} output_tokens={len(r.token_ids)} "
            f"finish={r.finish_reason} tier={r.tier} tokens/s={total_out / elapsed:.1f} (batch of {len(reqs)})"
        )
    return results
