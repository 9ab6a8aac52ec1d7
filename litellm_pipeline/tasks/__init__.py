"""The code behind the recipes: ``recipes/NAME.yaml`` sets ``task: NAME`` and runs ``litellm_pipeline/tasks/NAME.py``.

Every task module has ``run(cfg)``, which takes the composed config. A new recipe is the two files and nothing
else: :func:`run_task` finds the module by its name. What tasks share lives here: where a run writes
(:func:`output_dir`, :func:`write_json`), the validated config (:func:`app_config`) and the model's name in
reports (:func:`model_name`); a task's own section is validated with
:func:`litellm_pipeline.errors.section_settings`, and requests run to the end with
:meth:`litellm_pipeline.engine.engine.Engine.run`.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from litellm_pipeline.errors import ConfigError

if TYPE_CHECKING:
    from litellm_pipeline.config.schema import AppConfig


def known_tasks() -> list[str]:
    """The task modules of this package: one per recipe."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def run_task(cfg: Any) -> object:
    """Run the task the config names (``task: NAME``, set by ``+recipe=NAME``)."""
    name = cfg.get("task")
    if name is None:
        raise ConfigError("no task chosen: run a recipe, e.g. `python -m litellm_pipeline +recipe=generate`")
    if name not in known_tasks():
        raise ConfigError(f"task: unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    return importlib.import_module(f"{__name__}.{name}").run(cfg)


def output_dir() -> Path:
    """Hydra's run directory when inside a Hydra app, else the working directory."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        return Path.cwd()


def app_config(cfg: Any) -> AppConfig:
    """The composed config validated as a whole (one error listing every bad key)."""
    from litellm_pipeline.config.build import to_plain
    from litellm_pipeline.config.schema import validate_config

    return validate_config(to_plain(cfg))


def write_json(data: Any, name: str | Path) -> Path:
    """``data`` as indented JSON at ``name`` in the run's folder (a path given whole stays as it is)."""
    path = output_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def model_name(plain: dict) -> str:
    """The model a (plain) config runs, as reports name it."""
    path = plain["model"].get("path")
    return str(path) if path is not None else "embedded demo model"
