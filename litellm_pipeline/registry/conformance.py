"""Checks an entry against its kind's protocol (:mod:`litellm_pipeline.registry.interfaces`) when it is registered.

What can be checked without running anything: the entry's form (a class, or a Python function for the function
kinds), every method the protocol declares (present, callable, not abstract, and accepting the positional
arguments the engine passes), class attributes (and their values, for stages), and that the constructor accepts
what the builder passes. No protocol asks for instance attributes: what the engine reads of an entry, it reads
through a method. Nothing here runs on the per-token path.

Form comes first for a reason: config is trusted code, but a typo (or ``os:system``) in a
``"pkg.mod:Attr"`` name must never be called with the engine's arguments.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Callable, Protocol

from litellm_pipeline.registry.interfaces import INTERFACES, Interface

# dunder methods that are part of a protocol (the others are typing machinery)
_PROTOCOL_DUNDERS = frozenset({"__call__", "__len__", "__contains__", "__iter__"})
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Members:
    """What a protocol declares: methods (name -> the protocol's function), class and instance attributes."""

    def __init__(self, methods: dict[str, Callable], class_attrs: tuple[str, ...], instance_attrs: tuple[str, ...]):
        self.methods, self.class_attrs, self.instance_attrs = methods, class_attrs, instance_attrs


@lru_cache(maxsize=None)
def members(proto: type) -> Members:
    """The members ``proto`` and its protocol bases declare (``typing.ClassVar`` annotations: class attributes)."""
    methods: dict[str, Callable] = {}
    class_attrs: list[str] = []
    instance_attrs: list[str] = []
    for base in reversed(proto.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        for key, value in vars(base).items():
            if inspect.isfunction(value) and (not key.startswith("_") or key in _PROTOCOL_DUNDERS):
                methods[key] = value
        for key, ann in vars(base).get("__annotations__", {}).items():
            (class_attrs if "ClassVar" in str(ann) else instance_attrs).append(key)
    return Members(methods, tuple(class_attrs), tuple(instance_attrs))


def _positional_counts(fn: Callable) -> tuple[int, ...]:
    """How many positional arguments (after ``self``) the engine passes to a protocol method: the required ones,
    and all of them (``linear`` is called with and without ``bias``)."""
    params = [p for p in list(inspect.signature(fn).parameters.values())[1:] if p.kind in _POSITIONAL]
    required = sum(p.default is inspect.Parameter.empty for p in params)
    return tuple(sorted({required, len(params)}))


def _static_lookup(cls: type, name: str) -> Any:
    """``name`` as the class defines or inherits it, without the metaclass (every class has ``type.__call__``)."""
    for base in cls.__mro__:
        if name in vars(base):
            return vars(base)[name]
    return None


def _method_problem(cls: type, name: str, proto_fn: Callable) -> str | None:
    """None if ``cls.name`` can be called as the engine calls it; 'missing' or the reason it cannot otherwise."""
    raw = _static_lookup(cls, name)
    if raw is None or getattr(raw, "__isabstractmethod__", False):
        return "missing"
    if isinstance(raw, staticmethod):
        fn, implicit = raw.__func__, 0
    elif isinstance(raw, classmethod):
        fn, implicit = raw.__func__, 1
    elif callable(raw):
        fn, implicit = raw, 1
    else:
        return "missing"  # e.g. a plain value where a method is needed
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: nothing more to check
        return None
    for n in _positional_counts(proto_fn):
        try:
            sig.bind(*([None] * (implicit + n)))
        except TypeError:
            return f"{name} is called with {n} positional argument{'s' * (n != 1)} but its signature is {sig}"
    return None


def _stage_values(cls: type) -> list[str]:
    """The builder reads these three to check the graph: wrong values would fail later with a worse message."""
    out = []
    level = getattr(cls, "level", None)
    if level not in ("request", "step"):
        out.append(f"level must be 'request' or 'step' (got {level!r})")
    for attr in ("inputs", "outputs"):
        value = getattr(cls, attr, None)
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
            out.append(f"{attr} must be a tuple of context field names (got {value!r})")
    return out


_VALUE_CHECKS: dict[str, Callable[[type], list[str]]] = {"stage": _stage_values}


def _constructor_problem(iface: Interface, cls: type) -> str | None:
    if iface.build_args is None:
        return None
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    kwargs = dict.fromkeys(iface.build_kwargs)
    kwargs.update(dict.fromkeys(k for k in iface.build_kwargs_if_accepted if k in sig.parameters))
    args = [None] * iface.build_args
    try:
        (sig.bind if iface.build_exact else sig.bind_partial)(*args, **kwargs)
    except TypeError as exc:
        return f"cannot be built as {iface.built_as} (its signature is {sig}: {exc})"
    return None


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _class_problems(iface: Interface, cls: type) -> list[str]:
    m = members(iface.protocol)
    missing, wrong = [], []
    for name, proto_fn in m.methods.items():
        why = _method_problem(cls, name, proto_fn)
        if why == "missing":
            missing.append(name)
        elif why is not None:
            wrong.append(why)
    out = []
    if missing:
        out.append(f"missing methods: {', '.join(missing)}")
    absent = [a for a in m.class_attrs if _static_lookup(cls, a) is None]
    if absent:
        out.append(f"missing class attributes: {', '.join(absent)}")
    elif iface.kind in _VALUE_CHECKS:
        out += _VALUE_CHECKS[iface.kind](cls)
    if wrong:
        out.append("wrong parameters: " + "; ".join(wrong))
    ctor = _constructor_problem(iface, cls)
    if ctor is not None:
        out.append(ctor)
    return out


def _function_problems(iface: Interface, fn: Any) -> list[str]:
    n = _positional_counts(members(iface.protocol).methods["__call__"])[-1]
    if not inspect.isfunction(fn):
        return [f"{_where(fn)} is not a Python function ({_article(iface.kind)} {iface.kind} is a function of {n} arguments, "
                f"called as {iface.built_as})"]
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError as exc:
        return [f"{_where(fn)} cannot take the {n} arguments of a {iface.kind} ({exc}; called as {iface.built_as})"]
    return []


def conformance_error(kind: str, name: str, obj: Any) -> str | None:
    """None when ``obj`` can be registered as ``kind``/``name``; else one message naming the kind, the name and
    everything missing or wrong, e.g. ``kv_policy 'mine': missing methods: hit, forget (...)``."""
    iface = INTERFACES.get(kind)
    if iface is None:
        return None
    if iface.function:
        problems = _function_problems(iface, obj)
        return f"{kind} {name!r}: {problems[0]}" if problems else None
    if not inspect.isclass(obj):
        return (f"{kind} {name!r}: {_where(obj)} is not a class ({_article(kind)} {kind} entry is a class built as "
                f"{iface.built_as}; see {iface.qualname})")
    problems = _class_problems(iface, obj)
    if not problems:
        return None
    return f"{kind} {name!r}: {'; '.join(problems)} ({_where(obj)} does not satisfy {iface.qualname})"
