"""The registry: every swappable implementation is an entry ``(kind, name) -> object``.

Built-ins register with the :func:`register` decorator when their module is imported; the registry finds
those modules itself (:func:`builtin_modules`), so a new built-in needs nothing but its decorator. Third-party
packages add entries through Python entry points, loaded lazily the first time a kind is looked up:

* group ``litellm_pipeline.plugins``: each entry point names a module or a callable; loading it
  imports the module (whose decorators register entries) and, if it is callable, calls it.
* group ``litellm_pipeline.<kind>`` (e.g. ``litellm_pipeline.sampler``): the entry point's name is
  the registry name and its value (``"pkg.mod:Class"``) is imported on first use.

Every entry is checked against its kind's interface (:mod:`litellm_pipeline.registry.interfaces`) when it is
registered: an object that lacks a method fails then, naming the kind, the name and what is missing.
A plugin that fails to load (or registers such an object) is reported by name (a warning, the listing,
and every "unknown name" error), what it registered is taken back, and the other plugins are unaffected.
Which plugins load is filtered by ``plugins.allow`` / ``plugins.deny`` and their environment variables
(:mod:`litellm_pipeline.registry.filter`); a plugin the filter refuses is not imported, and one refused
after it loaded is hidden (and shown again, without reloading, when the filter allows it again).

Registering a name twice is an error; looking up an unknown name is an error listing the known ones.
A name of the form ``"pkg.mod:Attr"`` is imported directly (and checked the same way), so a config can
point at an implementation that lives in any importable module.

Lookups happen only while the pipeline is built, never on the per-token path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from litellm_pipeline.registry.conformance import conformance_error
from litellm_pipeline.registry.filter import PluginFilter

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
    "constraint",
    "proposer",
)
PLUGIN_GROUP = "litellm_pipeline.plugins"
_PACKAGE = __name__.split(".")[0]

T = TypeVar("T")


class RegistryError(LookupError):
    """Unknown kind, unknown name, a duplicate registration, or an entry that does not satisfy its interface."""


@dataclass(frozen=True)
class Origin:
    """Where an entry (or a plugin) comes from: built in, an entry point of a distribution, or run-time code."""

    builtin: bool = False
    plugin: str | None = None  # the plugin (entry point) it came through: its name, or "<kind>:<name>"
    dist: str | None = None
    version: str | None = None
    entry_point: str | None = None  # "group: name = value"
    module: str | None = None  # a run-time registration: the module of the object

    def __str__(self) -> str:
        if self.builtin:
            return "built-in"
        if self.dist:
            return f"{self.dist} {self.version}"
        if self.plugin:
            return f"entry point {self.entry_point}"
        return f"module {self.module}"


BUILTIN = Origin(builtin=True)

_entries: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
_origins: dict[str, dict[str, Origin]] = {k: {} for k in KINDS}  # also for not-yet-loaded lazy entries
_lazy: dict[str, dict[str, metadata.EntryPoint]] = {k: {} for k in KINDS}
_broken: dict[str, str] = {}  # plugin -> error text
_skipped: dict[str, str] = {}  # plugin -> why the filter refused it
_plugins: dict[str, Origin] = {}  # every plugin seen by the last scan
_hidden: dict[str, list[tuple[str, str, Any]]] = {}  # plugin -> (kind, name, obj) it registered, now refused
_clashes: dict[str, dict[str, str]] = {k: {} for k in KINDS}  # kind -> name -> why: plugins that share the name
_loaded: set[str] = set()  # litellm_pipeline.plugins entry points already loaded (never called twice)
_filter_settings: tuple[tuple[str, ...] | None, tuple[str, ...]] = (None, ())  # the config's (allow, deny)
_active_filter: PluginFilter | None = None  # the filter of the last scan (config and environment)
_loading: Origin | None = None  # the plugin being loaded: entries registered now come from it
_plugins_loaded = False
_builtins_loaded = False
_lock = threading.RLock()

# A built-in registers by a line `@register("kind", "name")` at the top level of its module: the modules that
# hold one are found by reading the package's sources (no list to keep), and imported with the registry -- except
# those marked with this line, which need an optional package (triton costs seconds to import and is absent from
# CPU-only installs): they are imported only when a config names one of their entries.
_REGISTER_LINE = re.compile(r'^@register\(\s*"(\w+)",\s*"([^"]+)"\s*\)', re.MULTILINE)
LAZY_MARK = "# registry: imported on first use"


@functools.lru_cache(maxsize=1)
def builtin_modules() -> tuple[tuple[str, ...], dict[str, dict[str, str]]]:
    """The package's modules that register built-ins: ``(imported with the registry, {kind: {name: module}}
    imported on first use)``, found by reading the sources."""
    root = Path(__file__).resolve().parents[1]
    eager: list[str] = []
    lazy: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found = _REGISTER_LINE.findall(text)
        if not found:
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if LAZY_MARK in text:
            for kind, name in found:
                lazy.setdefault(kind, {})[name] = module
        else:
            eager.append(module)
    return tuple(eager), lazy


def check_shape(kind: str, name: str, obj: Any) -> None:
    """Raise :class:`RegistryError` unless ``obj`` satisfies the interface of ``kind`` (see interface_check)."""
    error = conformance_error(kind, name, obj)
    if error is not None:
        raise RegistryError(error)


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


def _run_time_origin(obj: Any) -> Origin:
    module = getattr(obj, "__module__", None) or "?"
    return BUILTIN if module.split(".")[0] == _PACKAGE else Origin(module=module)


def add(kind: str, name: str, obj: Any) -> None:
    """Register ``obj`` as ``kind/name``: it must satisfy the kind's interface, and the name must be new."""
    _check_kind(kind)
    check_shape(kind, name, obj)
    with _lock:
        if name in _entries[kind]:
            prev = _entries[kind][name]
            raise RegistryError(
                f"duplicate {kind} name {name!r}: already registered by "
                f"{getattr(prev, '__module__', '?')}.{getattr(prev, '__qualname__', prev)!s}"
            )
        _entries[kind][name] = obj
        # a built-in imported while a plugin loads (the plugin imports the module) is still a built-in
        run_time = _run_time_origin(obj)
        _origins[kind][name] = run_time if run_time.builtin or _loading is None else _loading


def remove(kind: str, name: str) -> None:
    """Drop an entry (used by tests and by plugins that replace themselves)."""
    _check_kind(kind)
    with _lock:
        _entries[kind].pop(name, None)
        if name not in _lazy[kind]:
            _origins[kind].pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    for mod in builtin_modules()[0]:
        importlib.import_module(mod)
    _builtins_loaded = True  # only once all imported: a failed import raises again on the next lookup


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    try:
        return list(metadata.entry_points(group=group))
    except Exception:  # pragma: no cover - broken metadata on the path
        return []


def entry_point_origin(ep: metadata.EntryPoint, plugin: str) -> Origin:
    """The distribution (name, version) an entry point belongs to."""
    dist = getattr(ep, "dist", None)
    name = version = None
    if dist is not None:
        name, version = dist.metadata["Name"], dist.version
    return Origin(plugin=plugin, dist=name, version=version, entry_point=f"{ep.group}: {ep.name} = {ep.value}")


def _entries_of(plugin: str) -> list[tuple[str, str, Any]]:
    return [(k, n, obj) for k in KINDS for n, obj in _entries[k].items() if _origins[k].get(n, BUILTIN).plugin == plugin]


def _withdraw(plugin: str, keep: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str, Any]]:
    """Take back the entries ``plugin`` registered, except ``keep`` (it failed halfway, or the filter now
    refuses it)."""
    keep = set(keep)
    taken = [e for e in _entries_of(plugin) if e[:2] not in keep]
    for kind, name, _ in taken:
        del _entries[kind][name]
    return taken


def _restore(plugin: str) -> None:
    """Show a plugin's hidden entries again (the filter allows it again)."""
    for kind, name, obj in _hidden.pop(plugin, ()):
        if name in _entries[kind] and _entries[kind][name] is not obj:
            _broken[plugin] = f"duplicate {kind} name {name!r} (registered meanwhile by someone else)"
        else:
            _entries[kind][name] = obj


def _refuse(plugin: str, why: str) -> None:
    _skipped[plugin] = why
    taken = _withdraw(plugin)
    if taken:
        _hidden.setdefault(plugin, []).extend(taken)


def _load_eager(ep: metadata.EntryPoint, origin: Origin) -> None:
    """Import (and call) one ``litellm_pipeline.plugins`` entry point; a failure withdraws what it registered."""
    global _loading
    before = [e[:2] for e in _entries_of(ep.name)]  # a forced reload keeps what an earlier load registered
    _loading = origin
    try:
        obj = ep.load()
        if callable(obj) and not isinstance(obj, type):
            obj()
    except Exception as exc:  # a broken plugin must not take the others down
        _withdraw(ep.name, keep=before)
        _broken[ep.name] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"litellm_pipeline plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=3)
    finally:
        _loading = None


def _scan_lazy(kind: str, ep: metadata.EntryPoint, flt: PluginFilter) -> None:
    plugin = f"{kind}:{ep.name}"
    origin = entry_point_origin(ep, plugin)
    _plugins[plugin] = origin
    why = flt.refusal(ep.name, plugin, origin.dist)
    if why is not None:
        if _lazy[kind].pop(ep.name, None) is not None:
            del _origins[kind][ep.name]
        _refuse(plugin, why)
        return
    _restore(plugin)
    if ep.name not in _entries[kind]:
        _lazy[kind][ep.name] = ep
        _origins[kind][ep.name] = origin
    elif (_origins[kind][ep.name].plugin != plugin
          and getattr(_entries[kind][ep.name], "__module__", None) != ep.module):
        _broken[plugin] = f"duplicate {kind} name {ep.name!r} (from {ep.value})"
        warnings.warn(f"litellm_pipeline plugin entry {ep.value!r}: duplicate {kind} name {ep.name!r}", stacklevel=3)


def load_plugins(force: bool = False) -> dict[str, str]:
    """Scan the installed plugins (once, or again when the filter changed); returns ``{plugin: error}`` for those
    that failed. ``force``: forget failures and load every allowed plugin again."""
    global _plugins_loaded, _active_filter
    with _lock:
        if _plugins_loaded and not force:
            return dict(_broken)
        _plugins_loaded = True
        if force:
            _broken.clear()
            _loaded.clear()
        flt = _active_filter = PluginFilter.from_settings(*_filter_settings)
        _skipped.clear()
        for ep in _entry_points(PLUGIN_GROUP):
            origin = _plugins[ep.name] = entry_point_origin(ep, ep.name)
            why = flt.refusal(ep.name, origin.dist)
            if why is not None:
                _refuse(ep.name, why)
                continue
            _restore(ep.name)
            if ep.name not in _loaded:
                _loaded.add(ep.name)
                _load_eager(ep, origin)
        for kind in KINDS:
            for name in _clashes[kind]:  # found again below if they still clash
                _broken.pop(f"{kind}:{name}", None)
            _clashes[kind].clear()
            eps = _entry_points(f"litellm_pipeline.{kind}")
            for ep in _clashing(kind, eps, flt):
                _scan_lazy(kind, ep, flt)
        return dict(_broken)


def _clashing(kind: str, eps: list[metadata.EntryPoint], flt: PluginFilter) -> list[metadata.EntryPoint]:
    """The entry points of ``kind`` less those whose name another allowed plugin also gives (a different object):
    neither is used, both are broken plugins with an error naming both, and a lookup of the name says so."""
    by_name: dict[str, list[metadata.EntryPoint]] = {}
    for ep in eps:
        by_name.setdefault(ep.name, []).append(ep)
    keep = []
    for name, group in by_name.items():
        allowed = {(ep.value, _dist_of(ep)): ep for ep in group
                   if flt.refusal(ep.name, f"{kind}:{ep.name}", _dist_of(ep)) is None}
        if len({value for value, _ in allowed}) < 2:
            # one allowed (the others kept out by the filter, which is said as for any plugin): it alone is scanned,
            # since they share the plugin's name ``kind:name``
            keep.extend(group if len(group) == 1 or not allowed else allowed.values())
            continue
        both = " and ".join(f"{value} (distribution {dist or '?'})" for value, dist in sorted(allowed, key=str))
        why = (f"duplicate {kind} name {name!r}: {both} both register it, so neither is used "
               "(uninstall one, or keep one out with plugins.deny)")
        _clashes[kind][name] = why
        _broken[f"{kind}:{name}"] = why
        _plugins[f"{kind}:{name}"] = entry_point_origin(group[0], f"{kind}:{name}")
        if _lazy[kind].pop(name, None) is not None:
            _origins[kind].pop(name, None)
        warnings.warn(f"litellm_pipeline plugins: {why}", stacklevel=4)
    return keep


def _dist_of(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def set_plugin_filter(allow: Iterable[str] | None = None, deny: Iterable[str] = ()) -> None:
    """Apply ``plugins.allow`` / ``plugins.deny`` (the builder calls it before any lookup). Plugins are scanned
    again when this, or the environment variables, changed what is allowed since the last scan."""
    global _filter_settings, _plugins_loaded
    settings = (None if allow is None else tuple(allow), tuple(deny))
    with _lock:
        _filter_settings = settings
        if PluginFilter.from_settings(*settings) != _active_filter:
            _plugins_loaded = False


def broken_plugins() -> dict[str, str]:
    """``{plugin: error}`` of the plugins that failed to load."""
    return dict(_broken)


def skipped_plugins() -> dict[str, str]:
    """``{plugin: why}`` of the plugins that ``plugins.allow`` / ``plugins.deny`` kept out."""
    return dict(_skipped)


def plugin_origin(plugin: str) -> Origin | None:
    """The distribution a plugin (as named in :func:`broken_plugins` / :func:`skipped_plugins`) belongs to."""
    return _plugins.get(plugin)


def origin(kind: str, name: str) -> Origin:
    """Where ``kind/name`` comes from (``str(origin)``: ``built-in``, ``dist version`` or ``module m``)."""
    if name not in names(kind):
        raise _unknown(kind, name)
    return _origins[kind].get(name, BUILTIN)  # a lazy built-in not imported yet


def load_all() -> None:
    """Import every lazily declared entry now (the listing does, to show and check each); failures are recorded
    in :func:`broken_plugins` and leave the others alone."""
    for kind in KINDS:
        for name in list(names(kind)):
            if name in _lazy[kind]:
                try:
                    get(kind, name)
                except RegistryError:
                    pass


_STATE = ("_entries", "_origins", "_lazy", "_broken", "_skipped", "_plugins", "_hidden", "_loaded", "_clashes",
          "_filter_settings", "_active_filter", "_plugins_loaded")


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """For tests: whatever is registered, loaded or filtered inside is thrown away on exit.

    Built-ins and the installed plugins are loaded into the real registry first (a module plugin registers at
    its first import only, so importing it inside would lose its entries for good): enter this before putting
    a test's fake distributions on ``sys.path``."""
    names("stage")
    module = globals()
    with _lock:
        saved = {k: module[k] for k in _STATE}
        for k in _STATE:
            v = saved[k]
            if isinstance(v, dict):
                module[k] = {kk: (dict(vv) if isinstance(vv, dict) else list(vv) if isinstance(vv, list) else vv)
                             for kk, vv in v.items()}
            elif isinstance(v, set):
                module[k] = set(v)
    try:
        yield
    finally:
        with _lock:
            module.update(saved)


def names(kind: str) -> list[str]:
    """All known names of a kind: built-ins, registered plugins and not-yet-loaded entry points."""
    _check_kind(kind)
    _load_builtins()
    load_plugins()
    return sorted(set(_entries[kind]) | set(_lazy[kind]) | set(builtin_modules()[1].get(kind, ())))


def _unknown(kind: str, name: str) -> RegistryError:
    known = names(kind)
    msg = f"unknown {kind} {name!r}; known {kind} names: {', '.join(known) or '(none)'}"
    if _broken:
        msg += "; plugins that failed to load: " + ", ".join(f"{k} ({v})" for k, v in sorted(_broken.items()))
    if _skipped:
        msg += "; plugins not loaded: " + ", ".join(f"{k} ({v})" for k, v in sorted(_skipped.items()))
    return RegistryError(msg)


def get(kind: str, name: str) -> Any:
    """Look up ``kind/name``; ``"pkg.mod:Attr"`` names are imported directly."""
    _check_kind(kind)
    _load_builtins()
    load_plugins()
    with _lock:
        if name in _entries[kind]:
            return _entries[kind][name]
        if name in _clashes[kind]:
            raise RegistryError(_clashes[kind][name])
        if name in _lazy[kind]:
            ep = _lazy[kind].pop(name)
            plugin = f"{kind}:{name}"
            try:
                obj = ep.load()
                check_shape(kind, name, obj)
            except Exception as exc:
                _origins[kind].pop(name, None)
                _broken[plugin] = f"{type(exc).__name__}: {exc}"
                raise RegistryError(f"{kind} {name!r} comes from plugin {ep.value!r}, which failed to load: {exc}") from exc
            _entries[kind][name] = obj
            return obj
        module = builtin_modules()[1].get(kind, {}).get(name)
        if module is not None:
            try:
                importlib.import_module(module)  # registers the entry
            except ImportError as exc:
                raise RegistryError(f"{kind} {name!r} is built in but cannot load: {exc}") from exc
            if name in _entries[kind]:
                return _entries[kind][name]
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except Exception as exc:  # any import-time failure becomes one error naming the entry
            raise RegistryError(f"{kind} {name!r}: cannot import {attr!r} from {mod_name!r}: {exc}") from exc
        check_shape(kind, name, obj)
        return obj
    raise _unknown(kind, name)
