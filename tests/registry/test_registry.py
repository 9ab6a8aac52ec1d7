"""Registry: decorator registration, duplicate / unknown names, import strings, entry-point plugins."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
from fake_dists import TinyPolicy, TinySolver

from litellm_pipeline import registry
from litellm_pipeline.registry import RegistryError

# modules the fake distribution below provides; dropped from sys.modules after every test
FAKE_MODULES = ("fake_good_mod", "fake_broken_mod", "fake_cb_mod", "fake_lazy_mod", "fake_lazy_broken_mod", "fake_attr_mod")


@pytest.fixture
def fresh_registry():
    """The registry with built-ins (and installed plugins) loaded, on copies that are thrown away afterwards
    (``registry.isolated``), so the real state comes back unchanged whatever the test does."""
    with registry.isolated():
        yield registry
    for mod in FAKE_MODULES:
        sys.modules.pop(mod, None)


class TinySampler:
    def __call__(self, logits, rows): raise NotImplementedError


class TinyRouter:
    def __init__(self, model_cfg, device): pass
    def plan(self, schedule): return None


def _write_fake_dist(root, entry_points: str, modules: dict[str, str]) -> None:
    dist = root / "fakeplugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for name, src in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(src))


GOOD_MOD = """
    from litellm_pipeline.registry import register

    from fake_dists import TinyStepStage

    @register("stage", "fake_good_stage")
    class FakeGoodStage(TinyStepStage):
        pass
"""
CB_MOD = """
    from litellm_pipeline import registry

    class FakeRouter:
        def __init__(self, model_cfg, device):
            pass

        def plan(self, schedule):
            return None

    CALLS = []

    def setup():
        CALLS.append(1)
        registry.add("router", "fake_cb_router", FakeRouter)
"""
BROKEN_MOD = """
    raise RuntimeError("boom at import")
"""
LAZY_MOD = """
    class LazySampler:
        def __init__(self, **params):
            self.params = params

        def __call__(self, logits, rows):
            raise NotImplementedError
"""
# the broken plugin comes first, so the good ones are loaded after it failed
ENTRY_POINTS = """
    [litellm_pipeline.plugins]
    fake_broken = fake_broken_mod
    fake_good = fake_good_mod
    fake_cb = fake_cb_mod:setup

    [litellm_pipeline.sampler]
    fake_lazy = fake_lazy_mod:LazySampler
    fake_lazy_broken = fake_lazy_broken_mod:Nope
"""


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch, fresh_registry):
    """A fake installed distribution with good, broken, callable and lazy per-kind entry points."""
    _write_fake_dist(
        tmp_path,
        ENTRY_POINTS,
        {"fake_good_mod": GOOD_MOD, "fake_cb_mod": CB_MOD, "fake_broken_mod": BROKEN_MOD,
         "fake_lazy_mod": LAZY_MOD, "fake_lazy_broken_mod": BROKEN_MOD},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning) as record:
        broken = registry.load_plugins(force=True)
    return broken, [str(w.message) for w in record]


# -- decorator, duplicates, unknown names ------------------------------------------------------------


def test_decorator_registers_and_returns_object(fresh_registry):
    @registry.register("kv_policy", "test_lru")
    class TestLRU(TinyPolicy):
        pass

    assert TestLRU.__name__ == "TestLRU"  # the decorator hands the class back unchanged
    assert registry.get("kv_policy", "test_lru") is TestLRU
    assert "test_lru" in registry.names("kv_policy")
    assert "test_lru" not in registry.names("budget_solver")  # entries are per kind


def test_same_name_in_two_kinds_is_fine(fresh_registry):
    registry.add("kv_policy", "twin", TinyPolicy)
    registry.add("budget_solver", "twin", TinySolver)
    assert registry.get("kv_policy", "twin") is TinyPolicy
    assert registry.get("budget_solver", "twin") is TinySolver


def test_builtins_are_registered(fresh_registry):
    stages = registry.names("stage")
    for name in ("admit", "select_tier", "route", "prefill", "decode", "sample", "emit"):
        assert name in stages
    assert {"default", "greedy"} <= set(registry.names("sampler"))


def test_duplicate_name_is_an_error_naming_it(fresh_registry):
    @registry.register("kv_policy", "dup_policy")
    class First(TinyPolicy):
        pass

    with pytest.raises(RegistryError, match="dup_policy") as exc:

        @registry.register("kv_policy", "dup_policy")
        class Second(TinyPolicy):
            pass

    assert "duplicate" in str(exc.value)
    assert "First" in str(exc.value)  # says who holds the name already
    assert registry.get("kv_policy", "dup_policy") is First  # the first registration survives


def test_duplicate_of_a_builtin_is_an_error(fresh_registry):
    with pytest.raises(RegistryError, match="duplicate sampler name 'greedy'"):
        registry.add("sampler", "greedy", TinySampler)


def test_unknown_name_lists_known_names(fresh_registry):
    registry.add("sampler", "test_known_sampler", TinySampler)
    with pytest.raises(RegistryError) as exc:
        registry.get("sampler", "no_such_sampler")
    msg = str(exc.value)
    assert "no_such_sampler" in msg
    for name in ("default", "greedy", "test_known_sampler"):
        assert name in msg


def test_unknown_kind_is_an_error(fresh_registry):
    for call in (
        lambda: registry.get("nope_kind", "x"),
        lambda: registry.names("nope_kind"),
        lambda: registry.add("nope_kind", "x", object()),
        lambda: registry.register("nope_kind", "x"),
        lambda: registry.remove("nope_kind", "x"),
    ):
        with pytest.raises(RegistryError, match="nope_kind") as exc:
            call()
        assert "sampler" in str(exc.value)  # lists the known kinds


def test_remove(fresh_registry):
    registry.add("router", "temp_router", TinyRouter)
    registry.remove("router", "temp_router")
    assert "temp_router" not in registry.names("router")
    registry.remove("router", "temp_router")  # removing a missing name is a no-op


# -- "pkg.mod:Attr" import strings ---------------------------------------------------------------------


def test_import_string_lookup(fresh_registry):
    from litellm_pipeline.sampling.samplers import GreedySampler

    assert registry.get("sampler", "litellm_pipeline.sampling.samplers:GreedySampler") is GreedySampler


def test_import_string_from_any_module(fresh_registry, tmp_path, monkeypatch):
    (tmp_path / "fake_attr_mod.py").write_text(
        "class MyStage:\n    level = 'step'\n    inputs = ()\n    outputs = ()\n"
        "    def __init__(self, rt): pass\n    def __call__(self, ctx): pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    obj = registry.get("stage", "fake_attr_mod:MyStage")
    assert obj.__name__ == "MyStage" and obj.__module__ == "fake_attr_mod"


@pytest.mark.parametrize("name", ["litellm_pipeline.sampling.samplers:NoSuchClass", "no_such_pkg_xyz.mod:Thing"])
def test_bad_import_string_is_a_registry_error(fresh_registry, name):
    with pytest.raises(RegistryError, match=name.split(":")[0]) as exc:
        registry.get("sampler", name)
    assert "cannot import" in str(exc.value)


@pytest.mark.parametrize(
    "kind, name, text",
    [
        ("sampler", "os:system", "is not a class"),
        ("stage", "os:getcwd", "is not a class"),
        ("kv_policy", "collections:OrderedDict", "missing methods: add, remove, hit, forget"),
        ("stage", "litellm_pipeline.sampling.samplers:GreedySampler", "missing class attributes: level, inputs, outputs"),
        ("attention", "os:system", "is not a Python function"),
        ("attention", "litellm_pipeline.sampling.samplers:apply_penalties", "cannot take the 8 arguments"),
        ("telemetry", "litellm_pipeline.telemetry.events:StepFinished", "missing methods: publish"),
    ],
)
def test_import_string_must_have_the_shape_of_its_kind(fresh_registry, kind, name, text):
    with pytest.raises(RegistryError, match=text) as exc:
        registry.get(kind, name)
    assert name.split(":")[1] in str(exc.value)


def test_shell_command_in_config_never_runs(hf_checkpoint, tmp_path):
    from litellm_pipeline import LLM
    from litellm_pipeline.errors import ConfigError

    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match="is not a class"):
        LLM(model=str(hf_checkpoint("llama")), overrides=[
            "pipeline.stages.sample.params.sampler=os:system", f"+pipeline.stages.sample.params.command='touch {marker}'"
        ])
    assert not marker.exists()


# -- entry-point plugins ---------------------------------------------------------------------------------


def test_good_plugin_loads_despite_broken_one(fake_plugins):
    broken, _ = fake_plugins
    assert registry.get("stage", "fake_good_stage").__module__ == "fake_good_mod"
    assert "fake_good_stage" in registry.names("stage")
    assert "fake_broken" in broken and "fake_good" not in broken and "fake_cb" not in broken


def test_callable_plugin_is_called(fake_plugins):
    router = registry.get("router", "fake_cb_router")
    assert router.__name__ == "FakeRouter"
    assert sys.modules["fake_cb_mod"].CALLS == [1]  # called exactly once


def test_broken_plugin_is_reported_by_name(fake_plugins):
    broken, messages = fake_plugins
    assert set(registry.broken_plugins()) == {"fake_broken"}
    assert "RuntimeError" in registry.broken_plugins()["fake_broken"]
    assert "boom at import" in registry.broken_plugins()["fake_broken"]
    assert broken == registry.broken_plugins()
    assert any("fake_broken" in m and "boom at import" in m for m in messages)
    assert not any("fake_good" in m or "fake_cb" in m for m in messages)


def test_broken_plugin_appears_in_unknown_name_errors(fake_plugins):
    with pytest.raises(RegistryError) as exc:
        registry.get("stage", "no_such_stage")
    msg = str(exc.value)
    assert "fake_broken" in msg and "boom at import" in msg
    assert "fake_good_stage" in msg  # and the good plugin's entry is among the known names


def test_plugins_are_loaded_once(fake_plugins):
    registry.names("stage")
    registry.get("stage", "fake_good_stage")
    assert sys.modules["fake_cb_mod"].CALLS == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second (non-forced) load would warn about fake_broken again
        assert registry.load_plugins() == {"fake_broken": registry.broken_plugins()["fake_broken"]}


def test_per_kind_entry_point_is_lazy(fake_plugins):
    # listed as soon as plugins are scanned, but its module is imported by the first get only
    assert "fake_lazy" in registry.names("sampler")
    assert "fake_lazy_mod" not in sys.modules
    cls = registry.get("sampler", "fake_lazy")
    assert "fake_lazy_mod" in sys.modules
    assert cls is sys.modules["fake_lazy_mod"].LazySampler
    assert cls(a=1).params == {"a": 1}
    assert registry.get("sampler", "fake_lazy") is cls  # cached: the same object on the next lookup
    assert "fake_lazy" in registry.names("sampler")


def test_broken_lazy_entry_point_fails_on_get_only(fake_plugins):
    assert "fake_lazy_broken" in registry.names("sampler")
    assert "sampler:fake_lazy_broken" not in registry.broken_plugins()  # nothing imported yet
    with pytest.raises(RegistryError, match="fake_lazy_broken") as exc:
        registry.get("sampler", "fake_lazy_broken")
    assert "boom at import" in str(exc.value)
    assert "boom at import" in registry.broken_plugins()["sampler:fake_lazy_broken"]
    # the other lazy entry of the same kind is unaffected
    assert registry.get("sampler", "fake_lazy").__name__ == "LazySampler"


def test_state_is_restored_after_plugin_tests():
    # runs after the plugin tests (file order): nothing of the fake distribution leaked
    assert "fake_good_stage" not in registry.names("stage")
    assert "fake_lazy" not in registry.names("sampler")
    assert "fake_broken" not in registry.broken_plugins()


def test_every_builtin_registration_is_found_without_a_list():
    """Built-ins come through no hand-kept list: every ``@register(kind, name)`` decorator in the package (read
    here with ast, apart from the registry's own scan) is a known name, and its module is one the registry
    imports, or imports when a config names the entry (the triton ones)."""
    import ast
    from pathlib import Path

    import litellm_pipeline

    root = Path(litellm_pipeline.__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for dec in getattr(node, "decorator_list", ()):
                func = dec.func if isinstance(dec, ast.Call) else None
                if func is not None and getattr(func, "id", getattr(func, "attr", None)) == "register":
                    kind, name = (a.value for a in dec.args)
                    found.append((module, kind, name))
    assert len(found) >= 25 and {m for m, _, _ in found} >= {"litellm_pipeline.stages.decode",
                                                           "litellm_pipeline.model.triton_ops"}
    eager, lazy = registry.builtin_modules()
    for module, kind, name in found:
        assert name in registry.names(kind), (kind, name)
        assert module in eager or lazy.get(kind, {}).get(name) == module, (module, kind, name)
    assert not {m for m, _, _ in found if "triton" in m} & set(eager)  # triton stays out of a plain import


def test_two_plugins_giving_one_name_are_an_error_naming_both(tmp_path, monkeypatch, fresh_registry):
    """Two installed distributions whose per-kind entry points share a name: neither is used, both are broken
    plugins with an error naming both, and a lookup says why; denying one lets the other in."""
    from fake_dists import write_dist

    sampler = """
        class TwinSampler:
            def __call__(self, logits, rows):
                raise NotImplementedError
    """
    write_dist(tmp_path, "twin-a", "1.0", "[litellm_pipeline.sampler]\ntwin_sampler = twin_a_mod:TwinSampler\n",
               {"twin_a_mod.py": sampler})
    write_dist(tmp_path, "twin-b", "2.0", "[litellm_pipeline.sampler]\ntwin_sampler = twin_b_mod:TwinSampler\n",
               {"twin_b_mod.py": sampler})
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(UserWarning, match="twin_sampler"):
            broken = registry.load_plugins(force=True)
        why = broken["sampler:twin_sampler"]
        for part in ("twin_a_mod:TwinSampler", "twin_b_mod:TwinSampler", "twin-a", "twin-b", "duplicate"):
            assert part in why
        assert "twin_sampler" not in registry.names("sampler")
        with pytest.raises(RegistryError, match="twin_a_mod:TwinSampler.*twin_b_mod:TwinSampler"):
            registry.get("sampler", "twin_sampler")
        registry.set_plugin_filter(deny=["twin-b"])
        assert "sampler:twin_sampler" not in registry.load_plugins()
        assert registry.get("sampler", "twin_sampler") is sys.modules["twin_a_mod"].TwinSampler
    finally:
        for mod in ("twin_a_mod", "twin_b_mod"):
            sys.modules.pop(mod, None)


def test_built_ins_a_plugin_imports_while_loading_stay_built_ins():
    """Plugins loaded first (as ``pytest --litellm-conformance`` does) import built-in modules themselves: what those
    register is still built in, not the plugin's."""
    import subprocess

    code = (
        "from litellm_pipeline import registry\n"
        "registry.load_plugins()\n"
        "wrong = [(k, n, str(registry.origin(k, n))) for k in registry.KINDS for n, obj in registry._entries[k].items()\n"
        "         if getattr(obj, '__module__', '').startswith('litellm_pipeline.') and not registry.origin(k, n).builtin]\n"
        "print(wrong)\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"
