"""The embedded default model: a small Qwen3-MoE-format model trained on the skills corpus, shipped in ``checkpoint/``.

* :mod:`~litellm_pipeline.demo.skills` -- the seeded synthetic tasks (add, reverse, sort, copy, recall) and the
  train / held-out split;
* :mod:`~litellm_pipeline.demo.tokenizer` -- its character-level tokenizer;
* :mod:`~litellm_pipeline.demo.network` and :mod:`~litellm_pipeline.tasks.train_demo` -- the training-mode network
  (Mixtral or Qwen3-MoE layout) and the loop that wrote ``checkpoint/`` (``python -m litellm_pipeline +recipe=train_demo``);
* :mod:`~litellm_pipeline.tasks.eval` -- exact-match accuracy per task and tier (``+recipe=eval``).

The checkpoint is an ordinary Hugging Face directory, loaded through the same loader as any user checkpoint.
This module stays light (no torch): the builder imports it to find the default model.
"""

from __future__ import annotations

from pathlib import Path

from litellm_pipeline.demo.skills import (
    DEFAULT_EVAL_SEED,
    TASKS,
    Example,
    heldout,
    solve,
)

__all__ = ["CHECKPOINT_DIR", "demo_checkpoint", "demo_prompts", "solve"]

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"


def demo_checkpoint() -> Path:
    """The shipped trained checkpoint directory (an error naming the folder if it is missing)."""
    if not (CHECKPOINT_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded demo model is missing from {CHECKPOINT_DIR}: reinstall the package, or retrain it with "
            f"`python -m litellm_pipeline +recipe=train_demo train.out_dir={CHECKPOINT_DIR}`"
        )
    return CHECKPOINT_DIR


def demo_prompts(seed: int = 0) -> list[Example]:
    """One held-out example per task, chosen by ``seed`` (the default run shows these)."""
    return heldout(1, seed=DEFAULT_EVAL_SEED + seed, tasks=TASKS)

