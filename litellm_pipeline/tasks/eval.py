"""Exact-match accuracy of a model on held-out skills prompts, per task and per compute tier (``+recipe=eval``).

Greedy decoding, stopping at EOS; an answer counts only if the generated text equals the expected answer exactly.
Each tier runs as its own batch through the configured engine, so the measured tokens/s belong to that tier too.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from litellm_pipeline.demo.skills import (
    DEFAULT_EVAL_SEED,
    TASKS,
    Example,
    check_tasks,
    heldout,
)
from litellm_pipeline.errors import ConfigError, section_settings
from litellm_pipeline.sampling import SamplingParams


class EvalSettings(BaseModel):
    """The ``eval:`` config section (see recipes/eval.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_task: int = Field(default=100, ge=1)  # held-out prompts per task
    seed: int = DEFAULT_EVAL_SEED  # which held-out prompts
    tasks: list[str] = list(TASKS)
    tiers: list[str] | None = None  # null: every tier of the `tiers` config group
    max_tokens: int = Field(default=16, ge=1)  # the longest answer is 8 characters
    show_errors: int = Field(default=3, ge=0)  # wrong answers per tier to print (all of them go to eval.json)
    progress: bool = True


def eval_settings(section: Any) -> EvalSettings:
    s = section_settings(EvalSettings, section, "eval")
    try:
        check_tasks(s.tasks)
    except ValueError as exc:
        raise ConfigError(f"eval.tasks: {exc}") from exc
    return s


def run_tier(engine, examples: list[Example], params: SamplingParams, tier: str, bar) -> tuple[list[str], float, int]:
    """Generate for all examples at ``tier`` in one continuous batch: (texts, seconds, output tokens)."""
    t0 = time.perf_counter()
    outs = engine.run([engine.add_request(ex.prompt, params, tier=tier) for ex in examples],
                      on_finish=lambda _: bar.update(1))
    seconds = time.perf_counter() - t0
    return [o.text for o in outs], seconds, sum(len(o.token_ids) for o in outs)


def evaluate(engine, tiers: dict[str, Any], s: EvalSettings) -> dict:
    """Accuracy per tier and task (plus "all") on ``s.per_task`` held-out prompts per task."""
    examples = heldout(s.per_task, seed=s.seed, tasks=tuple(s.tasks))
    names = list(s.tiers) if s.tiers is not None else list(tiers)
    unknown = [t for t in names if t not in tiers]
    if unknown:
        raise ConfigError(f"eval.tiers: unknown tier(s) {unknown}; configured tiers: {', '.join(tiers)}")
    params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0)
    result: dict[str, Any] = {
        "per_task": s.per_task, "seed": s.seed, "tasks": list(s.tasks),
        "tiers": {}, "accuracy": {}, "errors": {},
    }
    bar = tqdm(total=len(names) * len(examples), desc="eval", unit="prompt", disable=not s.progress, dynamic_ncols=True)
    for tier in names:
        bar.set_postfix(tier=tier, refresh=True)
        texts, seconds, out_tokens = run_tier(engine, examples, params, tier, bar)
        right: dict[str, list[bool]] = {t: [] for t in s.tasks}
        errors = []
        for ex, text in zip(examples, texts):
            right[ex.task].append(text == ex.answer)
            if text != ex.answer:
                errors.append({"task": ex.task, "prompt": ex.prompt, "expected": ex.answer, "got": text})
        acc = {t: sum(v) / len(v) for t, v in right.items()}
        acc["all"] = sum(sum(v) for v in right.values()) / len(examples)
        ts = tiers[tier]
        result["tiers"][tier] = {
            "experts_per_token": getattr(ts, "experts_per_token", None),
            "cost": getattr(ts, "cost", None),
            "seconds": round(seconds, 3),
            "output_tokens_per_s": round(out_tokens / seconds, 1) if seconds > 0 else None,
        }
        result["accuracy"][tier] = acc
        result["errors"][tier] = errors
    bar.close()
    return result


def format_table(result: dict) -> str:
    tiers = list(result["accuracy"])
    cols = [*result["tasks"], "all"]
    head = f"{'tier':<10}{'experts':>8}" + "".join(f"{c:>9}" for c in cols)
    lines = [head, "-" * len(head)]
    for t in tiers:
        k = result["tiers"][t]["experts_per_token"]
        lines.append(f"{t:<10}{k if k is not None else '-':>8}" + "".join(f"{result['accuracy'][t][c]:>9.3f}" for c in cols))
    return "\n".join(lines)


def run(cfg) -> dict:
    """The ``eval`` task: build the configured engine, evaluate, print the table, write eval.json to the run dir."""
    from litellm_pipeline.config.build import build_engine, to_plain
    from litellm_pipeline.tasks import model_name, write_json

    plain = to_plain(cfg)
    s = eval_settings(plain.get("eval"))
    engine = build_engine(plain)
    result = evaluate(engine, engine.rt.tiers, s)
    result["model"] = model_name(plain)
    print(f"model: {result['model']}  ({s.per_task} held-out prompts per task, seed {s.seed}, greedy)")
    print(format_table(result))
    for tier, errors in result["errors"].items():
        for e in errors[: s.show_errors]:
            print(f"  {tier}: {e['prompt']} -> {e['got']!r} (expected {e['expected']})")
    print(f"wrote {write_json(result, 'eval.json')}")
    return result
