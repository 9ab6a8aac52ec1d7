"""Shared plumbing of the conformance kit: resolving what is checked, naming it in a config, and the demo engine.

A check takes either a registry name (``"lru"``, ``"my_policy"`` from an installed plugin, ``"pkg.mod:Class"``) or
the object itself. An object that is not registered (a class defined in a test) is registered under a throw-away
name for the duration of an engine run, because configs name implementations by string.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from litellm_pipeline import registry

_tmp_names = itertools.count()

# the demo model is tiny (4 layers, 47 tokens, 64 positions): an engine is built in about a second
ENGINE_BASE = ("device.threads=1", "device.type=cpu", "device.dtype=float32")
# prompts of the demo model's skills (see litellm_pipeline/demo/skills.py), each answered in a few tokens
DEMO_PROMPTS = ("copy:secret7=", "12+345=", "rev:abcdef=", "sort:93172=", "a3,b7,c1;b", "copy:hello=")


def describe(obj: Any) -> str:
    """``module.Qualname`` of an implementation, or its repr: what assertion messages call it."""
    if isinstance(obj, str):
        return repr(obj)
    mod, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{mod}.{name}" if mod and name else repr(obj)


def resolve(kind: str, impl: Any) -> Any:
    """The implementation object: a name goes through the registry (plugins and ``pkg.mod:Attr`` included)."""
    if isinstance(impl, str):
        return registry.get(kind, impl)
    return impl


@contextmanager
def config_name(kind: str, impl: Any) -> Iterator[str]:
    """A name a config can use for ``impl`` while the block runs.

    An object is registered under a throw-away name (an object may sit under several names) and removed
    afterwards; the registry refusing it (it lacks what every ``kind`` needs) is a conformance failure."""
    if isinstance(impl, str):
        yield impl
        return
    name = f"_conformance_{kind}_{next(_tmp_names)}"
    try:
        registry.add(kind, name, impl)
    except registry.RegistryError as exc:
        raise AssertionError(f"{kind} {describe(impl)} cannot be registered: {exc}") from exc
    try:
        yield name
    finally:
        registry.remove(kind, name)


def build_llm(overrides: Sequence[str] = (), **kwargs: Any):
    """An ``LLM`` over the embedded demo model, float32 on one CPU thread, plus ``overrides``."""
    from litellm_pipeline.llm import LLM

    return LLM(overrides=[*ENGINE_BASE, *overrides], **kwargs)


def assert_drained(llm, what: str) -> None:
    """Nothing in flight and every KV block back: all reference counts 0, the hot and warm pools whole."""
    engine = llm.engine
    pool = engine.rt.pool
    held = [b for b, c in enumerate(pool.ref_counts) if c]
    assert not held and pool.num_free == pool.num_blocks, (
        f"{what}: {len(held)} KV blocks still referenced after every request ended (blocks {held[:8]}); "
        f"{pool.num_free} of {pool.num_blocks} allocatable"
    )
    warm = engine.rt.kv.warm
    if warm is not None:
        assert warm.pool.is_empty(), f"{what}: {warm.num_held} warm-tier slots still held after every request ended"
    assert not engine.requests and not engine.has_unfinished(), (
        f"{what}: requests still in flight after the run: {sorted(engine.requests)}"
    )


def run_to_completion(engine, requests: Sequence, max_steps: int, what: str) -> int:
    """Step ``engine`` until every request has finished; fails naming the stragglers. Returns the steps taken."""
    for step in range(1, max_steps + 1):
        if all(r.finished for r in requests):
            return step - 1
        engine.step()
    left = [r.request_id for r in requests if not r.finished]
    assert not left, f"{what}: requests {left} did not finish within {max_steps} engine steps"
    return max_steps
