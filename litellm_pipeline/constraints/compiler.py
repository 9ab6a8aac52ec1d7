"""ConstraintCompiler: a request's constraint compiled once, off the step loop, within bounded time and size.

``compile(spec)`` runs on the thread that submits the request (never under the engine lock): it checks the
spec's size, finds its kind in the registry, and compiles it on a small pool of compile threads, waiting at
most ``compile_timeout_s``. xgrammar compiles without holding the GIL, so a slow compile costs a core, not the
batch. A spec that timed out is remembered and refused at once the next time; results are cached by a hash of
the spec (LRU, ``cache_entries``). Every refusal is an :class:`~litellm_pipeline.errors.InvalidRequestError`
naming ``constraint.<kind>`` and what was wrong (a 400 on the server).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from litellm_pipeline import registry
from litellm_pipeline.constraints.spec import ConstraintSpec
from litellm_pipeline.errors import InvalidRequestError, OverloadedError

__all__ = ["ConstraintSettings", "ConstraintCompiler"]


_MAX_TIMED_OUT = 4096  # specs remembered as too slow to compile


class _CompileThreads:
    """A fixed pool of daemon threads: a compile that never ends must not keep the process from exiting
    (``ThreadPoolExecutor`` joins its threads at exit)."""

    def __init__(self, n: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"constraint-compile-{i}", daemon=True).start()

    def submit(self, fn: Callable, arg: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, arg))
        return future

    def _work(self) -> None:
        while True:
            future, fn, arg = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up before it started
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)


@dataclass(frozen=True)
class ConstraintSettings:
    """``structured_output`` of the config (conf/structured_output/default.yaml)."""

    any_whitespace: bool = False
    max_spec_bytes: int = 65536
    compile_timeout_s: float = 10.0
    compile_threads: int = 2
    cache_entries: int = 256


class ConstraintCompiler:
    """Compiles requests' constraints for one engine. ``make_grammars`` builds the
    :class:`~litellm_pipeline.constraints.grammar.Grammars` the kinds compile with, on first use."""

    def __init__(self, make_grammars: Callable[[], Any], settings: ConstraintSettings = ConstraintSettings()):
        self.settings = settings
        self._make_grammars = make_grammars
        self._grammars = None
        self._kinds: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._timed_out: OrderedDict[str, None] = OrderedDict()
        self._pool: _CompileThreads | None = None
        self.compiles = 0  # compiles run (cache misses), for tests and the bench

    @property
    def grammars(self):
        with self._lock:
            if self._grammars is None:
                self._grammars = self._make_grammars()
            return self._grammars

    def _kind(self, name: str) -> Any:
        grammars = self.grammars
        with self._lock:
            kind = self._kinds.get(name)
            if kind is None:
                try:
                    cls = registry.get("constraint", name)
                except registry.RegistryError as exc:
                    raise InvalidRequestError("constraint", str(exc)) from None
                kind = self._kinds[name] = cls(grammars)
            return kind

    def compile(self, spec: ConstraintSpec) -> Any:
        """The compiled constraint of ``spec`` (its ``matcher()`` starts a request)."""
        field = f"constraint.{spec.kind}"
        text = spec.text
        limit = self.settings.max_spec_bytes
        size = len(text.encode("utf-8"))
        if size > limit:
            raise InvalidRequestError(field, f"is {size} bytes of JSON; at most {limit} are allowed")
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if key in self._timed_out:
                raise InvalidRequestError(field, self._timeout_text())
        kind = self._kind(spec.kind)
        with self._lock:
            if self._pool is None:
                self._pool = _CompileThreads(self.settings.compile_threads)
            pool = self._pool
        future = pool.submit(kind.compile, spec.value)
        try:
            compiled = future.result(timeout=self.settings.compile_timeout_s)
        except FutureTimeout:
            if future.cancel():  # it never started: every compile thread is busy with others
                raise OverloadedError("every constraint compile thread is busy; retry later",
                                      retry_after_s=self.settings.compile_timeout_s) from None
            with self._lock:
                self._timed_out[key] = None
                while len(self._timed_out) > _MAX_TIMED_OUT:
                    self._timed_out.popitem(last=False)
            raise InvalidRequestError(field, self._timeout_text()) from None
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(field, str(exc)) from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self.settings.cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def _timeout_text(self) -> str:
        return (f"took longer than {self.settings.compile_timeout_s:g} s to compile "
                "(structured_output.compile_timeout_s); simplify it")
