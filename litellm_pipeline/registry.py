"""The registry: every swappable implementation is an entry ``(kind, name) -> object``.

Built-ins register with the :func:`register` decorator when their module is imported. Third-party
packages add entries through Python entry points, loaded lazily the first time a kind is looked up:

* group ``litellm_pipeline.plugins``: each entry point names a module or a callable; loading it
  imports the module (whose decorators register entries) and, if it is callable, calls it.
* group ``litellm_pipeline.<kind>`` (e.g. ``litellm_pipeline.sampler``): the entry point's name is
  the registry name and its value (``"pkg.mod:Class"``) is imported on first use.

A plugin that fails to load is reported by name (a warning, and in every "unknown name" error) and
does not take the other plugins down. Registering a name twice is an error; looking up an unknown
name is an error listing the known ones. A name of the form ``"pkg.mod:Attr"`` is imported directly,
so a config can point at an implementation that lives in any importable module.

Lookups happen only while the pipeline is built, never on the per-token path.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from importlib import metadata
from typing import Any, Callable, TypeVar

KINDS: tuple[str, ...] = (
    "stage",
    "attention",
    "moe_dispatch",
    "layer_ops",
    "router",
    "sampler",
    "kv_policy",
    "budget_solver",
    "scheduler",
    "telemetry",
)
PLUGIN_GROUP = "litellm_pipeline.plugins"

T = TypeVar("T")


class RegistryError(LookupError):
    """Unknown kind, unknown name, or a duplicate registration."""


_entries: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
_lazy: dict[str, dict[str, metadata.EntryPoint]] = {k: {} for k in KINDS}
_broken: dict[str, str] = {}  # plugin name -> error text
_plugins_loaded = False
_builtins_loaded = False
_lock = threading.RLock()

# modules whose import registers the built-in entries
_BUILTIN_MODULES = (
    "litellm_pipeline.model.attention",
    "litellm_pipeline.model.attention_cpu",
    "litellm_pipeline.model.layer_ops",
    "litellm_pipeline.model.moe",
    "litellm_pipeline.routing",
    "litellm_pipeline.tiers.solvers",
    "litellm_pipeline.sampling.samplers",
    "litellm_pipeline.telemetry.bus",
    "litellm_pipeline.telemetry.prometheus",
    "litellm_pipeline.engine.scheduler",
    "litellm_pipeline.engine.fair_scheduler",
    "litellm_pipeline.engine.kv_policy",
    "litellm_pipeline.stages",
)


# What an entry of each kind must look like, checked before an import string's object (or a lazily loaded
# entry point) is ever called: a class with these methods / attributes, or a plain function taking this many
# positional parameters. Config is trusted code, but a typo (or "os:system") must not run something else.
_CLASS_SHAPES: dict[str, tuple[str, ...]] = {
    "stage": ("level", "inputs", "outputs", "__call__"),
    "layer_ops": ("linear", "rms_norm", "add_rms_norm", "silu_mul", "rotary", "route"),
    "router": ("plan",),
    "sampler": ("__call__",),
    "kv_policy": ("add", "remove", "hit", "forget", "pop", "__len__", "__contains__"),
    "budget_solver": ("solve",),
    "scheduler": ("add", "schedule", "finish", "has_unfinished"),
    "telemetry": ("publish",),
}
_FUNCTION_ARITY: dict[str, int] = {"attention": 8, "moe_dispatch": 6}


def check_shape(kind: str, name: str, obj: Any) -> None:
    """Raise :class:`RegistryError` unless ``obj`` has the shape of a ``kind`` entry (see ``_CLASS_SHAPES``)."""
    what = f"{kind} {name!r} resolves to {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
    if kind in _FUNCTION_ARITY:
        n = _FUNCTION_ARITY[kind]
        if not inspect.isfunction(obj):
            raise RegistryError(f"{what}, which is not a Python function (a {kind} is a function of {n} arguments)")
        try:
            inspect.signature(obj).bind(*range(n))
        except TypeError as exc:
            raise RegistryError(f"{what}, which cannot take the {n} arguments of a {kind} ({exc})") from None
        return
    if not inspect.isclass(obj):
        raise RegistryError(f"{what}, which is not a class (a {kind} entry is a class)")
    missing = [m for m in _CLASS_SHAPES.get(kind, ()) if not hasattr(obj, m)]
    if missing:
        raise RegistryError(f"{what}, which lacks {', '.join(missing)} (needed by every {kind})")


def _check_kind(kind: str) -> None:
    if kind not in _entries:
        raise RegistryError(f"unknown registry kind {kind!r}; known kinds: {', '.join(KINDS)}")


def register(kind: str, name: str) -> Callable[[T], T]:
    """Decorator: ``@register("kv_policy", "lru")`` adds the decorated object under that name."""
    _check_kind(kind)

    def deco(obj: T) -> T:
        add(kind, name, obj)
        return obj

    return deco


def add(kind: str, name: str, obj: Any) -> None:
    """Register ``obj`` as ``kind/name``; a duplicate name is an error."""
    _check_kind(kind)
    with _lock:
        if name in _entries[kind]:
            prev = _entries[kind][name]
            raise RegistryError(
                f"duplicate {kind} name {name!r}: already registered by "
                f"{getattr(prev, '__module__', '?')}.{getattr(prev, '__qualname__', prev)!s}"
            )
        _entries[kind][name] = obj


def remove(kind: str, name: str) -> None:
    """Drop an entry (used by tests and by plugins that replace themselves)."""
    _check_kind(kind)
    with _lock:
        _entries[kind].pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)
    _builtins_loaded = True  # only once all imported: a failed import raises again on the next lookup


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    try:
        return list(metadata.entry_points(group=group))
    except Exception:  # pragma: no cover - broken metadata on the path
        return []


def load_plugins(force: bool = False) -> dict[str, str]:
    """Load third-party entry points once; returns ``{plugin: error}`` for those that failed."""
    global _plugins_loaded
    with _lock:
        if _plugins_loaded and not force:
            return dict(_broken)
        _plugins_loaded = True
        if force:
            _broken.clear()
        for ep in _entry_points(PLUGIN_GROUP):
            try:
                obj = ep.load()
                if callable(obj) and not isinstance(obj, type):
                    obj()
            except Exception as exc:  # a broken plugin must not take the others down
                _broken[ep.name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"litellm_pipeline plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2)
        for kind in KINDS:
            for ep in _entry_points(f"litellm_pipeline.{kind}"):
                if ep.name not in _entries[kind]:
                    _lazy[kind][ep.name] = ep
                elif getattr(_entries[kind][ep.name], "__module__", None) != ep.module:
                    _broken[f"{kind}:{ep.name}"] = f"duplicate {kind} name {ep.name!r} (from {ep.value})"
                    warnings.warn(f"litellm_pipeline plugin entry {ep.value!r}: duplicate {kind} name {ep.name!r}", stacklevel=2)
        return dict(_broken)


def broken_plugins() -> dict[str, str]:
    return dict(_broken)


def names(kind: str) -> list[str]:
    """All known names of a kind: built-ins, registered plugins and not-yet-loaded entry points."""
    _check_kind(kind)
    _load_builtins()
    load_plugins()
    return sorted(set(_entries[kind]) | set(_lazy[kind]))


def get(kind: str, name: str) -> Any:
    """Look up ``kind/name``; ``"pkg.mod:Attr"`` names are imported directly."""
    _check_kind(kind)
    _load_builtins()
    load_plugins()
    with _lock:
        if name in _entries[kind]:
            return _entries[kind][name]
        if name in _lazy[kind]:
            ep = _lazy[kind].pop(name)
            try:
                obj = ep.load()
                check_shape(kind, name, obj)
            except Exception as exc:
                _broken[ep.name] = f"{type(exc).__name__}: {exc}"
                raise RegistryError(f"{kind} {name!r} comes from plugin {ep.value!r}, which failed to load: {exc}") from exc
            _entries[kind][name] = obj
            return obj
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except Exception as exc:  # any import-time failure becomes one error naming the entry
            raise RegistryError(f"{kind} {name!r}: cannot import {attr!r} from {mod_name!r}: {exc}") from exc
        check_shape(kind, name, obj)
        return obj
    known = names(kind)
    msg = f"unknown {kind} {name!r}; known {kind} names: {', '.join(known) or '(none)'}"
    if _broken:
        msg += "; plugins that failed to load: " + ", ".join(f"{k} ({v})" for k, v in sorted(_broken.items()))
    raise RegistryError(msg)
