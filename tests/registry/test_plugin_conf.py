"""Plugin config groups: an installed plugin declares a config package (entry point group
``litellm_pipeline.conf``) whose ``<group>/<option>.yaml`` files become options selectable from the command line
like the built-in ones; built-in options cannot be replaced, and the environment's deny list removes them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fake_dists import write_dist
from omegaconf import OmegaConf

from litellm_pipeline import registry
from litellm_pipeline.config.build import to_plain
from litellm_pipeline.config.compose import compose
from litellm_pipeline.config.schema import validate_config
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.registry.filter import ENV_ALLOW, ENV_DENY

ENTRY_POINTS = """
    [litellm_pipeline.conf]
    fake_conf = fake_conf_pkg.conf
    fake_conf_missing = pkg://fake_conf_missing_pkg.conf

    [litellm_pipeline.budget_solver]
    fake_conf_solver = fake_conf_pkg:CheapestSolver
"""
FILES = {
    "fake_conf_pkg/__init__.py": """
        class CheapestSolver:
            \"\"\"Always the cheapest choice that fits (a plugin's budget solver).\"\"\"

            def solve(self, problem):
                cheapest = problem.cheapest()
                return cheapest if problem.fits(cheapest.costs) else None
    """,
    "fake_conf_pkg/conf/__init__.py": "",
    # an option of an existing group: the built-in defaults, with this plugin's solver
    "fake_conf_pkg/conf/budget/fake_budget.yaml": """
        defaults:
          - default
          - _self_
        solver: fake_conf_solver
        latency_headroom: 0.35
    """,
    # a built-in option's name: must not replace the built-in
    "fake_conf_pkg/conf/budget/default.yaml": """
        solver: hijacked
    """,
    # a group only the plugin has
    "fake_conf_pkg/conf/fake_kv_opts/small_blocks.yaml": """
        # @package _global_
        cache:
          kv_policy: lfu
          block_size: 8
    """,
}
FAKE_MODULES = ("fake_conf_pkg", "fake_conf_pkg.conf")


@pytest.fixture
def conf_dist(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ALLOW, raising=False)
    monkeypatch.delenv(ENV_DENY, raising=False)
    with registry.isolated():  # entered before the fake distribution is on sys.path (see registry.isolated)
        write_dist(tmp_path, "fake-conf-dist", "0.5", ENTRY_POINTS, FILES)
        monkeypatch.syspath_prepend(str(tmp_path))
        registry.load_plugins(force=True)
        yield tmp_path
    for mod in FAKE_MODULES:
        sys.modules.pop(mod, None)


def test_plugin_option_of_an_existing_group(conf_dist):
    cfg = compose(["+recipe=generate", "budget=fake_budget"])
    assert cfg.budget.solver == "fake_conf_solver" and cfg.budget.latency_headroom == 0.35
    assert cfg.budget.weights.quality == 1.0  # the rest comes from the built-in default it extends
    assert compose(["+recipe=generate"]).budget.solver == "exact"  # selecting nothing changes nothing


def test_plugin_option_of_its_own_group(conf_dist):
    cfg = compose(["+recipe=generate", "+fake_kv_opts=small_blocks"])
    assert cfg.cache.kv_policy == "lfu" and cfg.cache.block_size == 8
    assert "fake_kv_opts" not in cfg  # a _global_ option: its keys land where it says


def test_builtin_option_cannot_be_replaced_by_a_plugin(conf_dist):
    assert compose(["budget=default"]).budget.solver == "exact"


def test_unknown_option_lists_the_plugin_options(conf_dist):
    with pytest.raises(Exception) as exc:
        compose(["budget=no_such_budget"])
    assert "fake_budget" in str(exc.value) and "default" in str(exc.value)


def test_environment_deny_removes_the_options(conf_dist, monkeypatch):
    monkeypatch.setenv(ENV_DENY, "fake-conf-dist")
    with pytest.raises(Exception, match="fake_budget"):
        compose(["budget=fake_budget"])
    monkeypatch.setenv(ENV_DENY, "conf:fake_conf")  # by the entry point, kind-qualified
    # without the group Hydra adds `+fake_kv_opts=...` as a plain key; the schema refuses it before anything runs
    cfg = compose(["+recipe=generate", "+fake_kv_opts=small_blocks"])
    assert cfg.cache.block_size == 16
    with pytest.raises(ConfigError, match="fake_kv_opts"):
        validate_config(to_plain(cfg))


def test_plugin_option_builds_an_engine_with_the_plugins_solver(conf_dist):
    from litellm_pipeline.config.build import build_engine

    engine = build_engine(compose(["+recipe=generate", "budget=fake_budget",
                                   "pipeline.stages.select_tier.params.mode=balanced"]))
    (select,) = [s for s in engine.request_stages if type(s).__name__ == "SelectTier"]
    assert type(select.selector.solver).__name__ == "CheapestSolver"
    assert str(registry.origin("budget_solver", "fake_conf_solver")) == "fake-conf-dist 0.5"


def test_listing_shows_plugin_options_and_a_missing_config_package(conf_dist):
    from litellm_pipeline.tasks.plugins import collect, render

    listing = collect()
    options = {o["select"]: o for o in listing["config_options"]}
    assert options["budget=fake_budget"]["origin"] == "fake-conf-dist 0.5"
    assert not options["budget=fake_budget"]["shadowed"]
    assert options["budget=default"]["shadowed"]
    assert "+fake_kv_opts=small_blocks" in options  # a new group is selected with +
    missing = listing["broken"]["conf:fake_conf_missing (fake-conf-dist 0.5)"]
    assert "'fake_conf_missing_pkg.conf' cannot be imported" in missing
    text = render(listing)
    assert "budget=default" in text and "shadowed by the built-in option of that name" in text


def test_plugin_option_from_the_command_line(conf_dist, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(conf_dist), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=generate", "budget=fake_budget",
           "+fake_kv_opts=small_blocks", "--cfg", "job"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.budget.solver == "fake_conf_solver" and cfg.cache.block_size == 8 and cfg.task == "generate"
