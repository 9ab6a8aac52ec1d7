"""LLM: the offline Python API (``LLM(model=...).generate(prompts, params)`` and ``.stream``)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from omegaconf import OmegaConf

from litellm_pipeline.config.build import build_engine
from litellm_pipeline.config.compose import compose
from litellm_pipeline.engine.request import Request, RequestOutput, request_output
from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.request_spec import Prompt, RequestSpec, to_spec
from litellm_pipeline.sampling import SamplingParams

# short keyword names for the config keys people set most
ALIASES = {
    "dtype": "device.dtype",
    "device": "device.type",
    "threads": "device.threads",
    "max_model_len": "model.max_model_len",
    "block_size": "cache.block_size",
    "num_blocks": "cache.num_blocks",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "tier": "pipeline.stages.select_tier.params.tier",
}


@dataclass
class StreamDelta:
    """What one engine step added to a streamed request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None


def _is_single(prompts: Any) -> bool:
    return isinstance(prompts, (str, RequestSpec)) or (
        isinstance(prompts, Sequence) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
    )


class LLM:
    """Build a pipeline from the config (plus overrides) and generate with it.

    ``LLM(model="/dir", dtype="bfloat16", **{"cache.block_size": 32}, overrides=["engine.max_num_seqs=8"])``:
    keyword names are config keys (dotted, or ``__`` for dots) or the short aliases in :data:`ALIASES`;
    ``overrides`` are Hydra override strings (``+recipe=NAME`` works too).
    """

    def __init__(self, model: str | None = None, *, overrides: Sequence[str] = (), **kwargs: Any):
        cfg = compose(list(overrides))
        OmegaConf.set_struct(cfg, False)
        if model is not None:
            OmegaConf.update(cfg, "model.path", str(model), merge=True)
        for key, value in kwargs.items():
            OmegaConf.update(cfg, ALIASES.get(key, key.replace("__", ".")), value, merge=True)
        self.cfg = cfg
        self.engine = build_engine(cfg)
        self.tokenizer = self.engine.tokenizer
        self._inbox: dict[str, deque] = {}
        self._final_only: set[str] = set()
        self._pump_lock = threading.RLock()

    def close(self) -> None:
        """Stop what the engine started outside this process (a parallel engine's workers); idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | RequestSpec | Sequence[Prompt | RequestSpec],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **fields: Any,
    ) -> list[RequestOutput]:
        """Generate for every prompt together (one batch); outputs come back in prompt order.

        A prompt is text, token ids or a whole :class:`RequestSpec`; ``params`` is one SamplingParams for all
        or one per prompt; keyword ``fields`` (``tier``, ``budget``, ``tenant``, ``priority``,
        ``session_id``, ...) are RequestSpec fields applied to every prompt. Any rejected prompt rejects the
        call and leaves nothing behind. A request that fails inside the engine comes back with
        ``finish_reason="error"`` and ``error`` set; the others are unaffected.
        """
        if isinstance(prompts, (Mapping, bytes)) or not isinstance(prompts, (Sequence, RequestSpec)):
            raise InvalidRequestError(
                "prompts", f"must be a prompt or a list of prompts (got {type(prompts).__name__})"
            )
        plist = [prompts] if _is_single(prompts) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist_params = [params] * len(plist)
        else:
            plist_params = list(params)
            if len(plist_params) != len(plist):
                raise InvalidRequestError(
                    "params", f"got {len(plist)} prompts but {len(plist_params)} SamplingParams"
                )
        if "request_id" in fields and len(plist) > 1:
            raise InvalidRequestError("request_id", "one id cannot name several prompts (give each a RequestSpec)")
        specs = [to_spec(p, sp, **fields) for p, sp in zip(plist, plist_params)]
        reqs = []
        try:
            for spec in specs:
                reqs.append(self.engine.add_request(spec))
                self._watch(reqs[-1], final_only=True)
        except Exception:
            for r in reqs:  # all or nothing: what was already admitted gives its memory back
                self.engine.abort(r.request_id)
                self._unwatch(r)
            raise
        final: dict[str, RequestOutput] = {}
        try:
            for r in reqs:
                while r.request_id not in final:
                    for out in self._outputs_of(r):
                        if out.finished:
                            final[r.request_id] = out
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        finally:
            for r in reqs:
                self._unwatch(r)
        return [final[r.request_id] for r in reqs]

    def stream(
        self, prompt: Prompt | RequestSpec, params: SamplingParams | None = None, **fields: Any
    ) -> Iterator[StreamDelta]:
        """Yield text deltas as tokens are made; closing the iterator early aborts the request.

        ``prompt`` and keyword ``fields`` as in :meth:`generate` (one request). A request that fails inside
        the engine raises :class:`InternalError`."""
        req = self.engine.add_request(to_spec(prompt, params, **fields))
        self._watch(req)
        done = False
        try:
            while not done:
                for out in self._outputs_of(req):
                    done = out.finished
                    out.raise_error()
                    if out.delta_text or out.delta_token_ids or done:
                        yield StreamDelta(out.delta_text, out.delta_token_ids, out.finish_reason)
        finally:
            self._unwatch(req)
            if not done:
                self.engine.abort(req.request_id)

    # ---- output routing: whoever steps the engine delivers every watched request's outputs to its inbox,
    # so concurrent generate/stream calls (threads, or interleaved iterators) never lose each other's output
    def _watch(self, req: Request, final_only: bool = False) -> None:
        with self._pump_lock:
            self._inbox[req.request_id] = deque()
            if final_only:
                self._final_only.add(req.request_id)

    def _unwatch(self, req: Request) -> None:
        with self._pump_lock:
            self._inbox.pop(req.request_id, None)
            self._final_only.discard(req.request_id)

    def _outputs_of(self, req: Request) -> list[RequestOutput]:
        """The request's outputs not yet taken, stepping the engine only while there are none."""
        rid = req.request_id
        with self._pump_lock:
            while True:
                box = self._inbox[rid]
                if box:
                    items = list(box)
                    box.clear()
                    return items
                if rid not in self.engine.requests:  # aborted elsewhere: report its end
                    return [request_output(req)]
                for out in self.engine.step():
                    dest = self._inbox.get(out.request_id)
                    if dest is not None and (out.finished or out.request_id not in self._final_only):
                        dest.append(out)
