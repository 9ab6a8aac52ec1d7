"""The example plugins of plugins/ run inside real pipelines, selected by config alone through their entry points,
and a plugin whose import raises is reported by name without taking the others (or the run) down.

CI installs every example plugin (.ci/run); where one is not installed its tests skip, saying how to install it.
"""

from __future__ import annotations

import textwrap
from importlib import metadata

import pytest

from litellm_pipeline import SamplingParams, registry
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.testing._support import assert_drained, build_llm

PLUGINS = {  # plugins/ folder -> distribution name
    "example_plugin": "litellm_pipeline_example_plugin",
    "cost_aware_kv": "litellm_pipeline_cost_aware_kv",
    "lagrangian_solver": "litellm_pipeline_lagrangian_solver",
    "phrase_filter": "litellm_pipeline_phrase_filter",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
FILTER = "+pipeline.stages.filter={impl: phrase_filter, params: {redact: [secret], stop: ['!']}}"
ORDER_WITH_FILTER = "pipeline.order=[admit,select_tier,route,prefill,decode,sample,filter,emit]"


def needs(*folders: str) -> None:
    for folder in folders:
        try:
            metadata.distribution(PLUGINS[folder])
        except metadata.PackageNotFoundError:
            pytest.skip(f"example plugin {PLUGINS[folder]} is not installed: pip install -e plugins/{folder}")


# one thread: these runs are many and small, and 2 threads only add contention on a 2-core machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_plugin_folder_is_covered_and_installed_by_ci():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    folders = sorted(p.name for p in (repo / "plugins").iterdir() if (p / "pyproject.toml").exists())
    assert folders == sorted(PLUGINS)
    ci = (repo / ".ci" / "run").read_text()
    assert [f for f in folders if f"-e plugins/{f} " not in ci and not ci.rstrip().endswith(f"-e plugins/{f}")] == []


def test_example_plugin_pipeline():
    needs("example_plugin")
    llm = build_llm(["+pipeline.stages.ban={impl: ban_tokens, params: {token_ids: [11]}}",
                     "pipeline.order=[admit,select_tier,route,prefill,decode,ban,sample,emit]",
                     "pipeline.stages.sample.params.sampler=example_argmax"])
    out = llm.generate("copy:secret7=", GREEDY)[0]
    assert out.text.startswith("secret") and 11 not in out.token_ids  # token 11 ("7") is banned
    assert_drained(llm, "example_plugin")


def test_cost_aware_kv_pipeline():
    needs("cost_aware_kv")
    prompts = ["copy:abcdefghij=", "copy:abcdefghiz=", "rev:abcdefghij=", "copy:abcdefghij="]
    runs = {}
    for policy in ("lru", "recompute_cost"):
        llm = build_llm([f"cache.kv_policy={policy}", "cache.block_size=4", "cache.num_blocks=12"])
        assert type(llm.engine.rt.pool.policy).__name__ == ("LRUPolicy" if policy == "lru" else "RecomputeCostPolicy")
        runs[policy] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert_drained(llm, policy)
    assert runs["recompute_cost"] == runs["lru"]


def test_lagrangian_solver_pipeline():
    needs("lagrangian_solver")
    llm = build_llm(["budget.solver=lagrangian", "pipeline.stages.select_tier.params.mode=balanced"])
    full = llm.generate("12+345=", GREEDY, tier="max")[0].cost.predicted_monetary
    out = llm.generate("12+345=", GREEDY, budget={"monetary_cost_units": full * 0.5})[0]
    assert out.cost.mode == "balanced" and out.cost.feasible
    assert out.cost.predicted_monetary <= full * 0.5
    assert_drained(llm, "lagrangian")


def test_phrase_filter_pipeline():
    needs("phrase_filter")
    llm = build_llm([FILTER, ORDER_WITH_FILTER])
    assert type(llm.engine.step_stages[-2]).__name__ == "PhraseFilter"  # between sample and emit
    assert llm.generate("copy:secret7=", GREEDY)[0].text == "******7"
    assert_drained(llm, "phrase_filter")


def test_all_new_plugins_in_one_pipeline():
    needs("cost_aware_kv", "lagrangian_solver", "phrase_filter")
    llm = build_llm(["cache.kv_policy=recompute_cost", "cache.block_size=4", "cache.num_blocks=16",
                     "budget.solver=lagrangian", "pipeline.stages.select_tier.params.mode=deep", FILTER,
                     ORDER_WITH_FILTER])
    outs = llm.generate(["copy:secret7=", "copy:secretz=", "12+345="], GREEDY, budget={"monetary_cost_units": 1.0})
    assert [o.text for o in outs] == ["******7", "******z", "357"]
    assert all(o.cost.mode == "deep" for o in outs)
    assert_drained(llm, "all plugins")


# -- a broken plugin ---------------------------------------------------------------------------------------

BROKEN_MODULE = """
    raise ImportError("this plugin is broken on purpose")
"""
ENTRY_POINTS = """
    [litellm_pipeline.plugins]
    broken_eager = fake_broken_plugin_mod

    [litellm_pipeline.kv_policy]
    broken_policy = fake_broken_plugin_mod:Policy
"""


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch):
    """A fake installed distribution whose eager and lazy entry points both import a module that raises; the
    registry's state is swapped for copies so nothing of it outlives the test."""
    registry.names("stage")  # the real plugins are loaded into the real registry first
    monkeypatch.setattr(registry, "_entries", {k: dict(v) for k, v in registry._entries.items()})
    monkeypatch.setattr(registry, "_lazy", {k: dict(v) for k, v in registry._lazy.items()})
    monkeypatch.setattr(registry, "_broken", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    dist = tmp_path / "fakebroken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakebroken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    (tmp_path / "fake_broken_plugin_mod.py").write_text(textwrap.dedent(BROKEN_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="broken_eager.*broken on purpose"):
        registry.load_plugins(force=True)
    yield
    import sys

    sys.modules.pop("fake_broken_plugin_mod", None)


def test_a_broken_plugin_is_reported_by_name_and_the_run_goes_on(broken_plugin):
    needs("cost_aware_kv", "phrase_filter")
    assert "ImportError: this plugin is broken on purpose" in registry.broken_plugins()["broken_eager"]
    # the working plugins loaded next to it and serve a pipeline
    llm = build_llm(["cache.kv_policy=recompute_cost", FILTER, ORDER_WITH_FILTER])
    assert llm.generate("copy:secret7=", GREEDY)[0].text == "******7"
    assert_drained(llm, "next to a broken plugin")
    # asking for the broken one is a config error naming the plugin and why it failed
    with pytest.raises(ConfigError, match=r"cache\.kv_policy: .*broken_policy.*broken on purpose"):
        build_llm(["cache.kv_policy=broken_policy"])
    assert any(k.endswith("broken_policy") for k in registry.broken_plugins()), registry.broken_plugins()
    # and an unknown name lists the broken plugins too
    with pytest.raises(ConfigError, match=r"plugins that failed to load: .*broken_eager"):
        build_llm(["cache.kv_policy=no_such_policy"])
