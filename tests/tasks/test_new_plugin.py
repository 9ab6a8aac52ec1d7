"""+recipe=new_plugin (litellm_pipeline.tasks.new_plugin): every kind's package installs and passes its own tests unchanged;
a bad kind, a bad name and an existing target are refused, naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.registry import KINDS as REGISTRY_KINDS
from litellm_pipeline.registry.interfaces import INTERFACES
from litellm_pipeline.tasks.new_plugin import KINDS, new_plugin, render

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(extra)
    return env


def test_every_registry_kind_is_supported():
    assert set(KINDS) == set(REGISTRY_KINDS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_generated_package_installs_and_passes_its_tests(kind, tmp_path):
    name = f"scaffolded_{kind}"
    pkg = new_plugin(name, kind, tmp_path)
    assert pkg == tmp_path / name
    files = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()}
    assert files == {"pyproject.toml", "README.md", "tests/test_conformance.py", f"litellm_pipeline_{name}/__init__.py",
                     f"litellm_pipeline_{name}/{kind}.py"}
    pyproject = (pkg / "pyproject.toml").read_text()
    assert f'[project.entry-points."litellm_pipeline.{kind}"]\n{name} = "litellm_pipeline_{name}.{kind}:' in pyproject
    code = (pkg / f"litellm_pipeline_{name}" / f"{kind}.py").read_text()
    assert INTERFACES[kind].protocol.__doc__.strip().splitlines()[0] in code  # the interface's docstrings
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--no-compile", "--target", str(site), str(pkg)],
                   check=True, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert list(site.glob(f"litellm_pipeline_{name}-*.dist-info"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=pkg,
                         env=_env(PYTHONPATH=str(site)), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_render_is_importable_python_for_every_kind():
    for kind in KINDS:
        for rel, text in render(f"x_{kind}", kind).items():
            if rel.endswith(".py"):
                compile(text, rel, "exec")


@pytest.mark.parametrize("kind", ["sampler", "router"])
def test_unknown_kind_lists_the_known_ones(tmp_path, kind):
    with pytest.raises(ConfigError) as err:
        new_plugin("good_name", kind + "s", tmp_path)
    msg = str(err.value)
    assert "plugin.kind" in msg and all(k in msg for k in KINDS)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["1abc", "my-plugin", "has space", "class", ""])
def test_bad_name_names_plugin_name(tmp_path, name):
    with pytest.raises(ConfigError, match=r"plugin\.name: .*Python identifier"):
        new_plugin(name, "kv_policy", tmp_path)
    assert not list(tmp_path.iterdir())


def test_name_of_an_existing_entry_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"plugin\.name: 'lru' is already a kv_policy name"):
        new_plugin("lru", "kv_policy", tmp_path)


def test_existing_target_is_not_overwritten(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"plugin\.dir: .*taken already exists; nothing was written"):
        new_plugin("taken", "stage", tmp_path)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert (target / "keep.txt").read_text() == "mine"


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "litellm_pipeline", "+recipe=new_plugin", *args,
                           "hydra.run.dir=" + str(cwd / "hydra_out"), "hydra.output_subdir=null"],
                          cwd=cwd, env=_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)


def test_cli_writes_into_the_current_directory_and_reports_errors(tmp_path):
    ok = _cli(["plugin.name=cli_policy", "plugin.kind=kv_policy"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "cli_policy" / "pyproject.toml").is_file()
    again = _cli(["plugin.name=cli_policy", "plugin.kind=kv_policy"], tmp_path)
    assert again.returncode == 2 and "plugin.dir:" in again.stderr and "already exists" in again.stderr
    bad_kind = _cli(["plugin.name=x", "plugin.kind=nope"], tmp_path)
    assert bad_kind.returncode == 2 and "plugin.kind: unknown kind; known kinds: stage," in bad_kind.stderr
    bad_name = _cli(["plugin.name=9x", "plugin.kind=stage", "plugin.dir=sub"], tmp_path)
    assert bad_name.returncode == 2 and "plugin.name:" in bad_name.stderr
    missing = _cli(["plugin.kind=stage"], tmp_path)
    assert missing.returncode == 2 and "plugin.name: required" in missing.stderr
    extra = _cli(["plugin.name=x", "plugin.kind=stage", "+plugin.colour=red"], tmp_path)
    assert extra.returncode == 2 and "plugin.colour: unknown key" in extra.stderr
    sub = _cli(["plugin.name=in_sub", "plugin.kind=sampler", "plugin.dir=sub"], tmp_path)
    assert sub.returncode == 0, sub.stderr
    assert (tmp_path / "sub" / "in_sub" / "tests" / "test_conformance.py").is_file()
