"""plugins.allow / plugins.deny (config) and LITELLM_PIPELINE_PLUGINS_ALLOW / _DENY (environment): which
entry-point plugins load. A refused plugin is not imported, is listed as skipped, and never hides a built-in."""

from __future__ import annotations

import sys

import pytest
from fake_dists import write_dist

from litellm_pipeline import registry
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.registry.filter import (
    ENV_ALLOW,
    ENV_DENY,
    PluginFilter,
    env_names,
)

# -- matching -------------------------------------------------------------------------------------------------


def test_names_match_entry_point_kind_qualified_and_distribution_names():
    f = PluginFilter.from_settings(deny=["alpha", "sampler:beta", "My.Dist"], environ={})
    assert f.refusal("alpha", "some-dist") == "denied by plugins.deny ('alpha')"
    assert f.refusal("beta", "sampler:beta", None) == "denied by plugins.deny ('sampler:beta')"
    assert f.refusal("beta", "router:beta", None) is None  # another kind's entry of that name
    # distribution names compare after PEP 503 normalisation
    assert f.refusal("gamma", "my_dist") == "denied by plugins.deny ('My.Dist')"
    assert f.refusal("gamma", "other") is None


def test_wildcards_and_deny_wins_over_allow():
    f = PluginFilter.from_settings(allow=["acme_*"], deny=["acme_bad"], environ={})
    assert f.refusal("acme_good") is None
    assert f.refusal("acme_bad") == "denied by plugins.deny ('acme_bad')"
    assert f.refusal("other") == "not in plugins.allow (acme_*)"
    assert PluginFilter.from_settings(deny=["*"], environ={}).refusal("anything") is not None


def test_empty_allow_list_allows_nothing_but_null_allows_all():
    assert PluginFilter.from_settings(allow=[], environ={}).refusal("x") == "not in plugins.allow (empty)"
    assert PluginFilter.from_settings(allow=None, environ={}).refusal("x") is None


def test_environment_narrows_the_config():
    env = {ENV_ALLOW: "a, b", ENV_DENY: "b"}
    f = PluginFilter.from_settings(allow=["a", "c"], environ=env)
    assert f.refusal("a") is None
    assert f.refusal("b") == f"denied by {ENV_DENY} ('b')"
    assert f.refusal("c") == f"not in {ENV_ALLOW} (a, b)"  # the config allows it, the environment does not
    # an unset or blank variable is no restriction
    assert env_names(None) is None and env_names("  ") is None and env_names("x,,y ") == ("x", "y")
    assert PluginFilter.from_settings(environ={ENV_ALLOW: ""}).refusal("x") is None


# -- the registry under a filter ---------------------------------------------------------------------------

MOD_A = """
    from litellm_pipeline.registry import register

    from fake_dists import TinyPolicy

    @register("kv_policy", "fake_filter_policy")
    class FilterPolicy(TinyPolicy):
        \"\"\"A policy from plugin A.\"\"\"
"""
MOD_B = """
    class FilterSolver:
        def solve(self, problem):
            return None
"""
ENTRY_POINTS = """
    [litellm_pipeline.plugins]
    fake_filter_a = fake_filter_a

    [litellm_pipeline.budget_solver]
    fake_filter_solver = fake_filter_b:FilterSolver
"""
FAKE_MODULES = ("fake_filter_a", "fake_filter_b")


@pytest.fixture
def reg(monkeypatch):
    """An isolated registry, entered before the fake distribution is on sys.path (isolated() scans the real
    plugins first, and that scan must not see it)."""
    monkeypatch.delenv(ENV_ALLOW, raising=False)
    monkeypatch.delenv(ENV_DENY, raising=False)
    for mod in FAKE_MODULES:
        sys.modules.pop(mod, None)
    with registry.isolated():
        yield registry
    for mod in FAKE_MODULES:
        sys.modules.pop(mod, None)


@pytest.fixture
def filter_dist(tmp_path, monkeypatch, reg):
    write_dist(tmp_path, "fake-filter-dist", "0.3", ENTRY_POINTS, {"fake_filter_a.py": MOD_A, "fake_filter_b.py": MOD_B})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.load_plugins(force=True)
    return registry


def _visible() -> tuple[bool, bool]:
    return "fake_filter_policy" in registry.names("kv_policy"), "fake_filter_solver" in registry.names("budget_solver")


def test_without_a_filter_both_plugins_load(filter_dist):
    assert _visible() == (True, True)
    assert str(registry.origin("kv_policy", "fake_filter_policy")) == "fake-filter-dist 0.3"
    assert registry.skipped_plugins() == {}


def test_deny_by_entry_point_name_hides_a_loaded_plugin_and_allowing_it_again_restores_it(filter_dist):
    registry.set_plugin_filter(None, ["fake_filter_a"])
    assert _visible() == (False, True)
    assert registry.skipped_plugins() == {"fake_filter_a": "denied by plugins.deny ('fake_filter_a')"}
    with pytest.raises(registry.RegistryError, match="plugins not loaded: fake_filter_a"):
        registry.get("kv_policy", "fake_filter_policy")
    registry.set_plugin_filter(None, ())
    assert _visible() == (True, True)  # shown again without importing or calling anything twice
    assert registry.skipped_plugins() == {}


def test_deny_by_distribution_name_covers_every_entry_point_of_it(filter_dist):
    registry.set_plugin_filter(None, ["Fake_Filter.Dist"])
    assert _visible() == (False, False)
    assert set(registry.skipped_plugins()) == {"fake_filter_a", "budget_solver:fake_filter_solver"}
    assert "exact" in registry.names("budget_solver") and "lru" in registry.names("kv_policy")  # built-ins stay


def test_allow_list_keeps_out_everything_else(filter_dist):
    registry.set_plugin_filter(["fake_filter_solver"], ())
    assert _visible() == (False, True)
    assert registry.skipped_plugins()["fake_filter_a"] == "not in plugins.allow (fake_filter_solver)"


def test_a_denied_plugin_is_never_imported(tmp_path, monkeypatch, reg):
    write_dist(tmp_path, "fake-filter-dist", "0.3", ENTRY_POINTS, {"fake_filter_a.py": MOD_A, "fake_filter_b.py": MOD_B})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENV_DENY, "fake_filter_a,budget_solver:fake_filter_solver")
    registry.set_plugin_filter(None, ())
    registry.load_plugins(force=True)
    registry.load_all()
    assert _visible() == (False, False)
    assert not any(mod in sys.modules for mod in FAKE_MODULES)
    assert registry.skipped_plugins()["fake_filter_a"] == f"denied by {ENV_DENY} ('fake_filter_a')"


def test_environment_change_applies_at_the_next_build(filter_dist, monkeypatch):
    monkeypatch.setenv(ENV_ALLOW, "nothing_here")
    registry.set_plugin_filter(None, ())  # what the builder calls: the environment is read again
    assert _visible() == (False, False)
    monkeypatch.delenv(ENV_ALLOW)
    registry.set_plugin_filter(None, ())
    assert _visible() == (True, True)


# -- through the config -----------------------------------------------------------------------------------


def test_config_deny_reaches_the_registry_before_any_lookup(filter_dist):
    from litellm_pipeline.config.build import build_engine
    from litellm_pipeline.config.compose import compose

    # fails at the first lookup, before any weight is read: the denied plugin's policy is unknown
    with pytest.raises(ConfigError) as exc:
        build_engine(compose(["+recipe=generate", "cache.kv_policy=fake_filter_policy",
                              "plugins.deny=[fake-filter-dist]"]))
    msg = str(exc.value)
    assert msg.startswith("cache.kv_policy: unknown kv_policy 'fake_filter_policy'")
    assert "fake_filter_a (denied by plugins.deny ('fake-filter-dist'))" in msg
    engine = build_engine(compose(["+recipe=generate", "cache.kv_policy=fake_filter_policy"]))
    assert type(engine.rt.pool.policy).__name__ == "FilterPolicy"


@pytest.mark.parametrize("override, text", [
    ("plugins.allow=[' ']", "plugins.allow[0]: must be a plugin name"),
    ("plugins.deny=some_plugin", "plugins.deny: input should be a valid list"),
    ("+plugins.only=[x]", "plugins.only"),
])
def test_bad_plugins_section_is_one_clear_error(override, text):
    from litellm_pipeline.config.build import to_plain
    from litellm_pipeline.config.compose import compose
    from litellm_pipeline.config.schema import validate_config

    with pytest.raises(ConfigError, match=text.replace("[", r"\[").replace("]", r"\]")):
        validate_config(to_plain(compose(["+recipe=generate", override])))
