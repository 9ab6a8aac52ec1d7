"""The package's rooms: a folder per concept, a task module per recipe, few loose modules, tests that mirror it.

A newcomer adding a solver, an endpoint, a sink or a recipe must know the one room to enter; these checks keep
the tree that way."""

from __future__ import annotations

import importlib
from pathlib import Path

import litellm_pipeline
from litellm_pipeline.tasks import known_tasks

PKG = Path(litellm_pipeline.__file__).resolve().parent
ROOT = PKG.parent
TESTS = Path(__file__).resolve().parent
# the public face: the command, the LLM front end, the request type and the errors a caller catches
LOOSE = {"__init__", "__main__", "llm", "request_spec", "errors"}


def test_at_most_eight_loose_modules_the_public_face():
    loose = {p.stem for p in PKG.glob("*.py")}
    assert loose == LOOSE and len(loose) <= 8


def test_every_recipe_has_its_task_module():
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    assert recipes == set(known_tasks())
    for name in recipes:
        text = (ROOT / "recipes" / f"{name}.yaml").read_text()
        assert f"task: {name}\n" in text, f"recipes/{name}.yaml must run tasks/{name}.py"
        assert callable(importlib.import_module(f"litellm_pipeline.tasks.{name}").run)


def test_tests_mirror_the_package():
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    test_dirs = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert test_dirs <= folders, f"test folders with no package folder: {sorted(test_dirs - folders)}"
    # a loose test module tests a loose module of the package (or the docs, or the tests' own helpers)
    for p in TESTS.glob("test_*.py"):
        stem = p.stem.removeprefix("test_")
        assert stem in {"cli", "docs", "layout", "hf_models"} | {m.strip("_") for m in LOOSE}, (
            f"{p.name}: put it in the tests folder of the package folder it tests"
        )
