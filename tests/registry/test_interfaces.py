"""Interfaces per registry kind (litellm_pipeline.registry.interfaces): every kind has a documented protocol, every
built-in satisfies its own, and an object that does not is refused when it is registered, with one message
naming the kind, the name and what is missing; entry-point plugins are checked the same way."""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest
from fake_dists import write_dist

from litellm_pipeline import registry
from litellm_pipeline.registry import RegistryError, interfaces
from litellm_pipeline.registry.conformance import (
    conformance_error,
    members,
)
from litellm_pipeline.stages.base import Stage

BUILTIN_NAMES = {
    "stage": {"admit", "select_tier", "route", "prefill", "decode", "sample", "emit"},
    "attention": {"sdpa", "cpu_paged"},
    "moe_dispatch": {"packed", "fused"},
    "layer_ops": {"torch", "cpu_fused"},
    "router": {"tierset"},
    "sampler": {"default", "greedy"},
    "kv_policy": {"lru", "lfu"},
    "budget_solver": {"exact", "greedy"},
    "scheduler": {"fcfs", "priority", "fair"},
    "telemetry": {"none", "memory", "prometheus"},
    "constraint": {"json_schema", "json_object", "regex", "choice", "grammar"},
    "proposer": {"ngram", "tier", "draft"},
}
FAKE_MODULES = ("fake_iface_bad", "fake_iface_half", "fake_iface_good", "fake_iface_lazy")


@pytest.fixture
def reg():
    with registry.isolated():
        yield registry
    for mod in FAKE_MODULES:
        sys.modules.pop(mod, None)


# -- the protocols ---------------------------------------------------------------------------------------


def test_every_registry_kind_has_an_interface():
    assert set(interfaces.INTERFACES) == set(registry.KINDS)
    assert set(BUILTIN_NAMES) == set(registry.KINDS)


@pytest.mark.parametrize("kind", registry.KINDS)
def test_every_interface_documents_what_is_called(kind):
    iface = interfaces.INTERFACES[kind]
    assert f"``{kind}``" in iface.protocol.__doc__  # the protocol says which kind it is for
    m = members(iface.protocol)
    assert m.methods, kind
    for name, fn in m.methods.items():
        assert fn.__doc__ and len(fn.__doc__.split()) >= 8, f"{kind}.{name} has no real docstring"


def test_protocol_members_are_what_the_engine_calls():
    # a change here is a change of the plugin interface: the engine's call sites must change with it
    assert list(members(interfaces.KVPolicy).methods) == ["add", "remove", "hit", "forget", "pop", "__len__",
                                                          "__contains__"]
    assert members(interfaces.PipelineStage).class_attrs == ("level", "inputs", "outputs")
    assert list(members(interfaces.Scheduler).methods) == ["add", "schedule", "postprocess", "load", "blocked",
                                                           "finish", "has_unfinished"]
    assert members(interfaces.Scheduler).instance_attrs == ()  # its queues are its own: readers ask load()
    assert set(members(interfaces.LayerOps).methods) == {"linear", "rms_norm", "add_rms_norm", "silu_mul", "rotary",
                                                        "residual_mlp", "route"}
    # optional hooks are documented but never required
    assert {"decode_attention", "decode_layers", "moe_experts"} <= set(members(interfaces.FusedLayerOps).methods)
    assert "describe" in members(interfaces.DescribedKVPolicy).methods
    assert "describe" not in members(interfaces.KVPolicy).methods
    assert interfaces.INTERFACES["kv_policy"].optional is interfaces.DescribedKVPolicy


@pytest.mark.parametrize("kind", registry.KINDS)
def test_builtins_satisfy_their_interface(kind):
    builtins = {n for n in registry.names(kind) if registry.origin(kind, n).builtin}
    assert builtins >= BUILTIN_NAMES[kind]
    for name in builtins:
        assert conformance_error(kind, name, registry.get(kind, name)) is None, name


def test_built_objects_satisfy_the_runtime_protocols():
    from litellm_pipeline.budget.solvers import ExactSolver, GreedySolver
    from litellm_pipeline.engine.kv_policy import LFUPolicy, LRUPolicy
    from litellm_pipeline.model.layer_ops import TorchLayerOps
    from litellm_pipeline.sampling.samplers import Sampler
    from litellm_pipeline.telemetry.bus import MemorySink

    for obj, proto in [(LRUPolicy(), interfaces.KVPolicy), (LFUPolicy(), interfaces.KVPolicy),
                       (TorchLayerOps(), interfaces.LayerOps), (Sampler(), interfaces.Sampler),
                       (MemorySink(), interfaces.TelemetrySink), (ExactSolver(), interfaces.BudgetSolver),
                       (GreedySolver(), interfaces.BudgetSolver)]:
        assert isinstance(obj, proto), (obj, proto)
    assert not isinstance(object(), interfaces.KVPolicy)


# -- registration refuses what does not satisfy its interface -----------------------------------------------

EMPTY_CLASS_MISSING = {
    "stage": ["missing methods: __call__", "missing class attributes: level, inputs, outputs",
              "cannot be built as cls(rt, **params)"],
    "layer_ops": ["missing methods: linear, rms_norm, add_rms_norm, silu_mul, rotary, residual_mlp, route"],
    "router": ["missing methods: plan", "cannot be built as cls(model_cfg, device, **params)"],
    "sampler": ["missing methods: __call__"],
    "kv_policy": ["missing methods: add, remove, hit, forget, pop, __len__, __contains__"],
    "budget_solver": ["missing methods: solve"],
    "scheduler": ["missing methods: add, schedule, postprocess, load, blocked, finish, has_unfinished", "cannot be built as cls(kv, "],
    "telemetry": ["missing methods: publish"],
}


@pytest.mark.parametrize("kind", sorted(EMPTY_CLASS_MISSING))
def test_registering_a_class_without_the_interface_names_everything_missing(reg, kind):
    class Mine:
        pass

    with pytest.raises(RegistryError) as exc:
        registry.add(kind, "mine", Mine)
    msg = str(exc.value)
    assert msg.startswith(f"{kind} 'mine': "), msg
    for text in EMPTY_CLASS_MISSING[kind]:
        assert text in msg
    assert interfaces.INTERFACES[kind].qualname in msg  # where to read what is needed
    assert "mine" not in registry.names(kind)  # nothing half-registered


def test_decorator_names_only_the_missing_methods(reg):
    with pytest.raises(RegistryError) as exc:

        @registry.register("kv_policy", "mine")
        class Mine:
            def add(self, block): ...
            def remove(self, block): ...
            def pop(self): ...
            def __len__(self): return 0
            def __contains__(self, block): return False

    assert str(exc.value).startswith("kv_policy 'mine': missing methods: hit, forget (")
    assert "mine" not in registry.names("kv_policy")


def test_a_method_with_the_wrong_parameters_is_refused(reg):
    from litellm_pipeline.engine.kv_policy import LRUPolicy
    from litellm_pipeline.model.layer_ops import TorchLayerOps

    class PopNeedsABlock(LRUPolicy):
        def pop(self, block):
            return block

    class LinearWithoutBias(TorchLayerOps):
        def linear(self, x, w):
            return x @ w.T

    with pytest.raises(RegistryError, match=r"wrong parameters: pop is called with 0 positional arguments but its "
                                            r"signature is \(self, block\)"):
        registry.add("kv_policy", "mine", PopNeedsABlock)
    # the engine calls linear with and without bias: a method that cannot take bias would fail mid-forward
    with pytest.raises(RegistryError, match="linear is called with 3 positional arguments"):
        registry.add("layer_ops", "mine", LinearWithoutBias)
    # static methods, class methods and defaults that cover both call forms are fine
    class Flexible(LRUPolicy):
        @staticmethod
        def hit(block): pass

        @classmethod
        def forget(cls, block): pass

        def pop(self, *args): return None

    registry.add("kv_policy", "flexible", Flexible)
    assert registry.get("kv_policy", "flexible") is Flexible


def test_constructor_must_take_what_the_builder_passes(reg):
    from litellm_pipeline.engine.kv_policy import LRUPolicy
    from litellm_pipeline.engine.scheduler import FcfsScheduler

    class NeedsCapacity(LRUPolicy):
        def __init__(self, capacity):
            super().__init__()

    with pytest.raises(RegistryError, match=r"kv_policy 'mine': cannot be built as cls\(\) .*capacity"):
        registry.add("kv_policy", "mine", NeedsCapacity)

    class NeedsWeights(FcfsScheduler):  # the builder passes weights=... to a scheduler that has the parameter
        def __init__(self, kv, max_num_seqs, max_num_batched_tokens, preemption, bus=None, *, weights):
            super().__init__(kv, max_num_seqs, max_num_batched_tokens, preemption, bus)

    class NeedsMore(FcfsScheduler):
        def __init__(self, kv, max_num_seqs, max_num_batched_tokens, preemption, bus=None, *, quantum):
            super().__init__(kv, max_num_seqs, max_num_batched_tokens, preemption, bus)

    registry.add("scheduler", "weighted", NeedsWeights)
    with pytest.raises(RegistryError, match="scheduler 'mine': cannot be built as .*quantum"):
        registry.add("scheduler", "mine", NeedsMore)


def test_stage_class_attributes_are_checked(reg):
    class NoCall(Stage):  # inherits Stage.__call__, which is abstract
        inputs = ("samples",)
        outputs = ("samples",)

    class BadLevel(Stage):
        level = "batch"
        inputs = "samples"  # a string, not a tuple: the builder would check its characters
        outputs = ("samples",)

        def __call__(self, ctx): pass

    with pytest.raises(RegistryError, match="stage 'no_call': missing methods: __call__"):
        registry.add("stage", "no_call", NoCall)
    with pytest.raises(RegistryError) as exc:
        registry.add("stage", "bad_level", BadLevel)
    assert "level must be 'request' or 'step' (got 'batch')" in str(exc.value)
    assert "inputs must be a tuple of context field names (got 'samples')" in str(exc.value)


def test_function_kinds_are_checked_for_form_and_arity(reg):
    def seven(q, k, v, k_cache, v_cache, meta, scale):
        return q

    def anything(*args):
        return args[0]

    with pytest.raises(RegistryError, match="attention 'seven': .*seven cannot take the 8 arguments"):
        registry.add("attention", "seven", seven)
    with pytest.raises(RegistryError, match="moe_dispatch 'cls': .* is not a Python function"):
        registry.add("moe_dispatch", "cls", Stage)
    registry.add("attention", "anything", anything)
    assert "anything" in registry.names("attention")


def test_a_non_class_is_refused_for_class_kinds(reg):
    with pytest.raises(RegistryError, match=r"sampler 'obj': .* is not a class \(a sampler entry is a class built "
                                            r"as cls\(\*\*params\)"):
        registry.add("sampler", "obj", object())


# -- a scheduler owns its queues: the engine and the stages only call it ----------------------------------


class _NoLoad:
    """A scheduler of the old shape: queues as attributes, no load() snapshot and no postprocess()."""

    def __init__(self, kv, max_num_seqs, max_num_batched_tokens, preemption="recompute", bus=None):
        self.running, self.waiting, self.max_num_seqs = [], [], max_num_seqs

    def add(self, req): self.waiting.append(req)
    def schedule(self): return []
    def blocked(self): return None
    def finish(self, req): pass
    def has_unfinished(self): return bool(self.waiting or self.running)


def test_a_scheduler_without_load_or_postprocess_is_refused(reg):
    with pytest.raises(RegistryError, match=r"scheduler 'old_shape': .*postprocess.*load"):
        registry.add("scheduler", "old_shape", _NoLoad)


def test_scheduler_load_is_a_snapshot():
    from litellm_pipeline.engine.scheduler import FcfsScheduler
    from litellm_pipeline.registry.types import SchedulerLoad

    kv = SimpleNamespace(hot=None, block_size=16, commit=lambda req: committed.append(req),
                         trim=lambda req: None)
    committed: list = []
    s = FcfsScheduler(kv, 4, 64)
    a = SimpleNamespace(prompt_ids=[1, 2, 3], num_computed=0)
    b = SimpleNamespace(prompt_ids=[1, 2], num_computed=2)
    s.add(a)
    s.running.append(b)
    load = s.load()
    assert load == SchedulerLoad((b,), (a,), 4) and load.in_flight == (b, a)
    assert load.queued_prompt_tokens() == 3
    s.waiting.clear()
    assert load.waiting == (a,)  # a copy: what the reader holds does not move under it
    s.postprocess([(a, 2), (b, 1)])
    assert (a.num_computed, b.num_computed) == (2, 3) and committed == [a, b]


# -- entry-point plugins are checked the same way ----------------------------------------------------------

BAD_MOD = """
    from litellm_pipeline.registry import register

    @register("kv_policy", "fake_bad_policy")
    class BadPolicy:
        def add(self, block): pass
"""
HALF_MOD = """
    from litellm_pipeline import registry

    class GoodSolver:
        def solve(self, problem):
            return None

    class BadSolver:
        pass

    def setup():
        registry.add("budget_solver", "fake_half_good", GoodSolver)
        registry.add("budget_solver", "fake_half_bad", BadSolver)
"""
GOOD_MOD = """
    from litellm_pipeline.registry import register

    @register("budget_solver", "fake_good_solver")
    class GoodSolver:
        def solve(self, problem):
            return None
"""
LAZY_MOD = """
    class NotASampler:
        pass
"""
ENTRY_POINTS = """
    [litellm_pipeline.plugins]
    fake_iface_bad = fake_iface_bad
    fake_iface_half = fake_iface_half:setup
    fake_iface_good = fake_iface_good

    [litellm_pipeline.sampler]
    fake_not_a_sampler = fake_iface_lazy:NotASampler
"""


@pytest.fixture
def iface_plugins(tmp_path, monkeypatch, reg):
    write_dist(tmp_path, "fake_iface_dist", "2.0", ENTRY_POINTS,
               {"fake_iface_bad.py": BAD_MOD, "fake_iface_half.py": HALF_MOD, "fake_iface_good.py": GOOD_MOD,
                "fake_iface_lazy.py": LAZY_MOD})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning):
        return registry.load_plugins(force=True)


def test_plugin_failing_its_interface_is_reported_by_name(iface_plugins):
    broken = iface_plugins
    assert "kv_policy 'fake_bad_policy': missing methods: remove, hit, forget, pop, __len__, __contains__" in \
        broken["fake_iface_bad"]
    assert "budget_solver 'fake_half_bad': missing methods: solve" in broken["fake_iface_half"]
    assert "fake_iface_good" not in broken
    assert "fake_good_solver" in registry.names("budget_solver")  # the others are unaffected
    assert "fake_bad_policy" not in registry.names("kv_policy")
    # what a failing plugin registered before it failed is taken back: no half-loaded plugin
    assert "fake_half_good" not in registry.names("budget_solver")
    assert str(registry.origin("budget_solver", "fake_good_solver")) == "fake_iface_dist 2.0"


def test_lazy_entry_failing_its_interface_fails_on_get(iface_plugins):
    assert "fake_not_a_sampler" in registry.names("sampler")  # declared, not imported yet
    with pytest.raises(RegistryError, match="sampler 'fake_not_a_sampler': missing methods: __call__"):
        registry.get("sampler", "fake_not_a_sampler")
    assert "missing methods: __call__" in registry.broken_plugins()["sampler:fake_not_a_sampler"]
    assert "fake_not_a_sampler" not in registry.names("sampler")


def test_unknown_name_error_mentions_the_broken_plugin(iface_plugins):
    with pytest.raises(RegistryError) as exc:
        registry.get("kv_policy", "fake_bad_policy")
    assert "unknown kv_policy 'fake_bad_policy'" in str(exc.value)
    assert "fake_iface_bad (" in str(exc.value) and "missing methods" in str(exc.value)


def test_interface_checks_never_touch_the_step_path():
    # checks happen in registry.add/get and the builder; the engine and the stages never import the checker
    import litellm_pipeline.engine.engine as engine
    import litellm_pipeline.stages.sample as sample

    for mod in (engine, sample):
        assert "interface_check" not in inspect.getsource(mod)


def test_contracts_depend_on_nothing_below_them():
    """The contracts load with the data types they name (registry.types) and no implementation: importing them
    in a fresh interpreter imports no module that registers a built-in, and not torch."""
    import subprocess

    code = (
        "import sys, litellm_pipeline.registry.interfaces as i; "
        "print(' '.join(m for m in sys.modules if m.startswith('litellm_pipeline'))); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    loaded = set(out[0].split())
    eager, lazy = registry.builtin_modules()
    implementations = set(eager) | {m for by_name in lazy.values() for m in by_name.values()}
    assert "litellm_pipeline.registry.types" in loaded
    assert not loaded & implementations, sorted(loaded & implementations)
    assert out[1] == "False"
    # every data type a protocol names is importable from beside it, not only under TYPE_CHECKING
    from litellm_pipeline.registry import types

    for name in ("AttentionMetadata", "RoutePlan", "SamplingRow", "SamplerOutput", "Problem", "Solution", "Event"):
        assert getattr(interfaces, name) is getattr(types, name)
