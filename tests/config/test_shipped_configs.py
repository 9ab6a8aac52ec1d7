"""Every shipped config group option and every recipe is not only composed but built: the engine is
instantiated on the embedded demo model (no download), and a recipe's task section is validated by the
task that reads it."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from test_compose import _group_overrides

from litellm_pipeline.bench.settings import bench_settings
from litellm_pipeline.config.build import build_engine, to_plain
from litellm_pipeline.config.compose import compose, known_recipes
from litellm_pipeline.demo import demo_checkpoint
from litellm_pipeline.engine.engine import Engine
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.tasks.budget_load import load_settings
from litellm_pipeline.tasks.calibrate import calibrate_settings
from litellm_pipeline.tasks.eval import eval_settings
from litellm_pipeline.tasks.faults import fault_settings
from litellm_pipeline.tasks.sweep import sweep_settings
from litellm_pipeline.tasks.train_demo import train_settings

TASK_SECTIONS = {"bench": bench_settings, "eval": eval_settings, "train_demo": train_settings, "faults": fault_settings,
                 "calibrate": calibrate_settings, "sweep": sweep_settings, "report": None,
                 "budget_load": load_settings}
_NEEDS_CUDA = {"device=cuda"}


def _build_and_run(cfg) -> Engine:
    engine = build_engine(cfg)
    assert isinstance(engine, Engine)
    req = engine.add_request("1+2=", SamplingParams(max_tokens=3, temperature=0.0))
    while not req.finished:
        engine.step()
    assert req.output_ids and engine.rt.pool.is_empty()
    return engine


@pytest.mark.parametrize("override", _group_overrides())
def test_every_group_option_builds_an_engine(override):
    if override in _NEEDS_CUDA and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # the draft proposer's checkpoint is the one thing its option cannot name: the demo model drafts for itself
    extra = [f"speculative.model={demo_checkpoint()}"] if override == "speculative=draft" else []
    _build_and_run(compose(["+recipe=generate", override, *extra]))


@pytest.mark.parametrize("name", known_recipes())
def test_every_recipe_builds_its_engine_and_task_settings(name):
    cfg = compose([f"+recipe={name}"])
    task = cfg.get("task")
    assert task is not None, f"recipe {name} sets no task"
    section = {"bench": "bench", "eval": "eval", "train_demo": "train", "faults": "faults",
               "calibrate": "calibrate", "sweep": "sweep", "budget_load": "budget_load"}.get(task)
    if section is not None:
        TASK_SECTIONS[task](to_plain(cfg[section]) if OmegaConf.is_config(cfg[section]) else cfg[section])
    _build_and_run(cfg)
