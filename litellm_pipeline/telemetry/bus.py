"""EventBus and the built-in sinks (registry kind ``telemetry``).

A sink is any object with ``publish(event)``; it is built once with its config ``params`` and must be
fast (it runs inside the engine step, under the engine lock). ``none`` drops everything (and disables the
bus when it is the only sink); ``memory`` keeps counts per event kind and the latest events, for tests and
the bench.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any, Iterable, Protocol, Sequence, TypeVar

from litellm_pipeline.registry import register
from litellm_pipeline.telemetry.events import Event

E = TypeVar("E", bound=Event)


class Sink(Protocol):
    def publish(self, event: Event) -> None: ...


@register("telemetry", "none")
class NullSink:
    """Drops every event; a bus with only this sink is disabled, so nothing is even built."""

    def publish(self, event: Event) -> None:
        pass


@register("telemetry", "memory")
class MemorySink:
    """Counts events per kind and keeps the latest ``max_events`` of them (thread-safe)."""

    def __init__(self, max_events: int = 100_000):
        if max_events < 1:
            raise ValueError(f"max_events: must be >= 1 (got {max_events})")
        self.events: deque[Event] = deque(maxlen=max_events)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def publish(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)
            self.counts[event.kind] += 1

    def of(self, cls: type[E]) -> list[E]:
        """The kept events of one type, oldest first."""
        with self._lock:
            return [e for e in self.events if type(e) is cls]

    def total(self, cls: type[Event], field: str) -> float:
        """Sum of one numeric field over the kept events of a type (e.g. ``BlocksEvicted``, ``num_blocks``)."""
        return sum(getattr(e, field) for e in self.of(cls))

    def clear(self) -> None:
        with self._lock:
            self.events.clear()
            self.counts.clear()


class EventBus:
    """Fans events out to its sinks. ``enabled`` is False when no sink listens: publishers test it first."""

    def __init__(self, sinks: Iterable[Any] = ()):
        self.sinks = tuple(s for s in sinks if not isinstance(s, NullSink))
        self.enabled = bool(self.sinks)

    def publish(self, event: Event) -> None:
        for s in self.sinks:
            s.publish(event)

    def subscribe(self, sink: Any) -> None:
        """Add a sink while the engine runs (e.g. the bench listening during one phase)."""
        if not isinstance(sink, NullSink):
            self.sinks = (*self.sinks, sink)
            self.enabled = True

    def unsubscribe(self, sink: Any) -> None:
        self.sinks = tuple(s for s in self.sinks if s is not sink)
        self.enabled = bool(self.sinks)

    def sink(self, cls: type[E]) -> E | None:
        """The first sink of a type (``bus.sink(MemorySink)``), or None."""
        return next((s for s in self.sinks if isinstance(s, cls)), None)


def build_bus(specs: Sequence[tuple[str, dict]]) -> EventBus:
    """A bus over the sinks named in ``telemetry.sinks`` (registry names, each with its params)."""
    from litellm_pipeline import registry

    return EventBus(registry.get("telemetry", name)(**params) for name, params in specs)
