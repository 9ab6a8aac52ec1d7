"""Telemetry: one event bus for everything the runtime reports.

The engine, the scheduler and the KV cache manager publish typed events (:mod:`.events`) to an
:class:`EventBus`; sinks (registry kind ``telemetry``, chosen by ``telemetry.sinks``) subscribe. Nothing
else keeps counters. With only the ``none`` sink the bus is disabled and publishers skip building events
(one attribute test per site), so the per-token path pays nothing.
"""

from litellm_pipeline.telemetry.bus import (
    EventBus,
    MemorySink,
    NullSink,
    Sink,
    build_bus,
)
from litellm_pipeline.telemetry.events import *  # noqa: F401,F403
from litellm_pipeline.telemetry.events import __all__ as _event_names

__all__ = ["EventBus", "Sink", "NullSink", "MemorySink", "build_bus", *_event_names]
