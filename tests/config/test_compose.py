"""Config composition: every shipped config and recipe composes, `+recipe=NAME` resolves (or fails
loudly), and the same works from an installed wheel outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from litellm_pipeline.config.compose import (
    compose,
    config_dir,
    known_recipes,
    recipes_dir,
)

ROOT = Path(__file__).resolve().parents[2]


def _group_overrides() -> list[str]:
    """One override per option yaml in a group folder of conf/: `group=opt`, or `+group=opt` when
    the group is not in the primary defaults list."""
    root = config_dir()
    defaults = OmegaConf.load(root / "config.yaml").get("defaults") or []
    in_defaults = {str(k).split("@")[0] for d in defaults if OmegaConf.is_dict(d) for k in d}
    overrides = []
    for yaml in sorted(root.rglob("*.yaml")):
        rel = yaml.relative_to(root)
        if len(rel.parts) > 1 and rel.parts[0] != "hydra":  # hydra/launcher=...: Hydra's groups (test_sweep)
            group = rel.parent.as_posix()
            overrides.append(f"{'' if group in in_defaults else '+'}{group}={rel.stem}")
    return overrides


def test_recipe_generate_sets_task():
    assert "generate" in known_recipes()
    assert compose(["+recipe=generate"]).task == "generate"


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(Exception) as err:
        compose(["+recipe=no_such_recipe"])
    assert "no_such_recipe" in str(err.value)
    assert "Available options in 'recipe'" in str(err.value)
    for name in known_recipes():
        assert name in str(err.value)


def test_recipe_never_becomes_a_plain_key():
    # without our source on the search path Hydra would silently add `recipe: generate`
    with pytest.raises(ValueError, match="plain config key"):
        compose(["+recipe=generate", "hydra.searchpath=[]"])


@pytest.mark.parametrize("override", _group_overrides())
def test_every_group_option_composes(override):
    cfg = compose([override])
    OmegaConf.to_container(cfg, resolve=True)
    group, option = override.lstrip("+").split("=")
    assert OmegaConf.select(cfg, group.replace("/", ".")) is not None, override


@pytest.mark.parametrize("name", sorted(p.stem for p in config_dir().glob("*.yaml")))
def test_every_primary_config_composes(name):
    OmegaConf.to_container(compose(config_name=name), resolve=True)


@pytest.mark.parametrize("name", known_recipes())
def test_every_recipe_composes(name):
    cfg = compose([f"+recipe={name}"])
    OmegaConf.to_container(cfg, resolve=True)
    assert cfg.task is not None  # a recipe says what to run


def test_compose_leaves_hydra_state_alone():
    assert not GlobalHydra.instance().is_initialized()
    compose(["+recipe=generate"])
    compose(["device=cuda"])
    assert not GlobalHydra.instance().is_initialized()

    import hydra

    # called from inside a running Hydra app (e.g. the Python API used by a task function)
    with hydra.initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        outer = GlobalHydra.instance().hydra
        assert compose(["+recipe=generate"]).task == "generate"
        assert GlobalHydra.instance().hydra is outer
    assert not GlobalHydra.instance().is_initialized()


_APP = """
import sys
from litellm_pipeline.config.compose import hydra_main
def run(cfg):
    print("TASK", cfg.task, "SEED", cfg.seed, flush=True)
hydra_main(run)()
"""


def test_hydra_main_runs_recipes_and_multirun(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def app(*args):
        return subprocess.run([sys.executable, "-c", _APP, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    out = app("-m", "+recipe=generate", "seed=1,2")
    assert out.returncode == 0, out.stderr
    assert "TASK generate SEED 1" in out.stdout and "TASK generate SEED 2" in out.stdout

    bad = app("+recipe=no_such_recipe")
    assert bad.returncode != 0
    assert "no_such_recipe" in bad.stderr and "generate" in bad.stderr


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """(wheel, source snapshot it was built from).

    Built from a copy of the checkout so the shared tree gets no build/ or *.egg-info (a stale
    build/lib would also leak deleted modules into the wheel), and without build isolation so the
    test needs no index and uses the venv's setuptools.
    """
    src = tmp_path_factory.mktemp("src") / "litellm_pipeline"
    anywhere = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "outputs",
                                      "multirun", ".pytest_cache")

    def ignore(folder: str, names: list[str]) -> set[str]:
        # tests/ and the example plugins/ only at the top: conf/plugins/ is a config group the wheel ships
        top = {"tests", "plugins"} & set(names) if Path(folder) == ROOT else set()
        return set(anywhere(folder, names)) | top

    shutil.copytree(ROOT, src, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out)], check=True, timeout=300)
    (wheel,) = out.glob("litellm_pipeline-*.whl")
    return wheel, src


def test_wheel_ships_every_module_and_yaml(built_wheel):
    wheel, src = built_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"litellm_pipeline/{p.relative_to(src / 'litellm_pipeline').as_posix()}"
                for p in (src / "litellm_pipeline").rglob("*.py")}
    for folder in ("conf", "recipes"):
        expected |= {f"litellm_pipeline/{folder}/{p.relative_to(src / folder).as_posix()}"
                     for p in (src / folder).rglob("*.yaml")}
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel (add the subpackage to [tool.setuptools] packages): {missing}"


def test_installed_wheel_composes_recipes(built_wheel, tmp_path):
    wheel, _ = built_wheel
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(target), str(wheel)], check=True, timeout=300)
    # Imports only hydra_config: the rest of the package may pull in heavier modules.
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        import litellm_pipeline.config.compose as h
        site = Path(sys.argv[1]).resolve()
        for p in (h.__file__, h.config_dir(), h.recipes_dir()):
            assert Path(p).resolve().is_relative_to(site), p
        print("RECIPES", ",".join(h.known_recipes()))
        print("TASK", h.compose(["+recipe=generate", "device=cuda"]).task)
    """)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code, str(target)], cwd=wheel.parent, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "TASK generate" in out.stdout
    assert f"RECIPES {','.join(known_recipes())}" in out.stdout
    assert recipes_dir() == ROOT / "recipes"  # this process still uses the checkout
