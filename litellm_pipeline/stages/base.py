"""Stage: one node of the declared pipeline graph (registry kind ``stage``).

A stage class declares its ``level`` ("request": runs once when a request is submitted, on a
:class:`RequestContext`; "step": runs once per engine step over the whole batch, on a :class:`StepContext`),
the context fields it reads (``inputs``) and the ones it writes (``outputs``). The builder checks that
every input is produced upstream before anything runs. Stages are built once with the shared
:class:`~litellm_pipeline.engine.runtime.Runtime` and their config ``params`` as plain keyword arguments.

Row order convention of a step: the schedule lists multi-token entries (prefill chunks) first, then
single-token entries (decodes), and every step-level stage lays its per-token tensors out in that order.

Who owns what: request-level stages decide and may reject (raise
:class:`~litellm_pipeline.errors.InvalidRequestError`); the engine queues a request only after all of them
pass. Step-level stages transform the step context and only *read* request state; the engine's postprocess
then advances computed tokens, commits KV blocks, appends the sampled tokens, finishes and frees. A step
must end with ``samples`` (what the engine appends); ``emissions`` (text deltas, proposed finishes) are
optional.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

from litellm_pipeline.engine.request import Request

if TYPE_CHECKING:
    from litellm_pipeline.engine.kv_cache_manager import KVLayout


class Stage:
    level: ClassVar[str] = "step"
    inputs: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    # fields used when an upstream stage produced them (the graph check refuses one produced only downstream)
    optional_inputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, rt):
        # subclasses with parameters declare them as keyword arguments: the builder checks a config's
        # params against that signature before anything is loaded
        self.rt = rt

    # abstract (without ABCMeta, so Stage itself stays instantiable): the registry refuses a subclass that
    # does not override it, at registration rather than at the first step
    @abstractmethod
    def __call__(self, ctx) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class RequestContext:
    """Fields of one request flowing through the request-level stages."""

    def __init__(self, request: Request):
        self.request = request


class StepContext:
    """Fields of one engine step. The engine provides ``schedule`` (``[(request, num_new_tokens), ...]`` in
    row order) and ``kv_layout`` (where those tokens' K/V live); stages add the rest (``route_plan``,
    ``prefill_batch``, ``logits``, ``sample_requests``, ``samples``, ``emissions``, ...)."""

    def __init__(self, schedule: list[tuple[Request, int]], kv_layout: KVLayout):
        self.schedule = schedule
        self.kv_layout = kv_layout
