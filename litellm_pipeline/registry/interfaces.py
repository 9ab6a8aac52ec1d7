"""What an implementation of each registry kind must do: one ``typing.Protocol`` per kind.

Each protocol lists exactly what the engine calls (derived from its call sites in ``engine/``, ``stages/``,
``model/``, ``tiers/``, ``sampling/`` and ``telemetry/``), when, with which shapes and dtypes, and what must hold.
:data:`INTERFACES` maps a kind to its protocol and to how the engine builds an entry; the registry checks every
entry against it when it is registered (:mod:`litellm_pipeline.registry.conformance`), so a plugin that lacks a method
fails at registration, naming the kind, the name and what is missing, never at the first request.

Conventions: ``T`` is the number of tokens of an engine step (prompt chunks first, then one token per decoding
request: the *row order*), ``R`` the requests sampled in a step, ``V`` the vocabulary, ``H`` the hidden size, ``D``
the head size, ``Hq``/``Hk`` the query / KV heads, ``E`` the experts, ``K`` the experts per token, ``I`` an expert's
intermediate size. "Activation dtype" is ``device.dtype`` (float32, bfloat16 or float16). Everything here is called
after the build, on plain values: an implementation never sees a config object, and must not look anything up in
the registry per call.

Kinds whose entries are plain functions (``attention``, ``moe_dispatch``) are written as protocols with
``__call__``; the registry requires a Python function of that many positional arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Mapping,
    Protocol,
    Sequence,
    runtime_checkable,
)

from litellm_pipeline.registry.types import (
    AttentionMetadata,
    Event,
    Problem,
    RoutePlan,
    SamplerOutput,
    SamplingRow,
    SchedulerLoad,
    Solution,
)

if TYPE_CHECKING:  # torch (and the Request, which holds a torch generator) only annotate: the registry stays cheap
    import torch

    from litellm_pipeline.engine.request import Request

__all__ = [
    "PipelineStage", "TextFilter", "Attention", "MoEDispatch", "LayerOps", "FusedLayerOps", "Router", "Sampler", "KVPolicy",
    "DescribedKVPolicy", "Matcher", "CompiledConstraint", "Constraint", "BudgetSolver", "Proposer", "Scheduler", "TelemetrySink", "Interface", "INTERFACES", "REFERENCE_TOLERANCE",
]

# (atol, rtol) an attention, moe_dispatch or layer_ops entry must meet against the reference (``sdpa``,
# ``packed``, ``torch``) per activation dtype, as in torch.testing.assert_close. The built-in C++ entries meet
# the float32 bound and are bit-identical in half precision; these are the bounds the parity tests can absorb.
REFERENCE_TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "bfloat16": (1e-2, 1e-2),
    "float16": (1e-2, 1e-2),
}


@runtime_checkable
class PipelineStage(Protocol):
    """Kind ``stage``: one node of the pipeline graph (``pipeline.order`` / ``pipeline.stages``).

    Built once per engine, after the model is loaded, as ``cls(rt, **params)``: ``rt`` is the engine's
    :class:`~litellm_pipeline.engine.runtime.Runtime` (model, tokenizer, KV manager, scheduler, tiers, device,
    bus), ``params`` the plain values of ``pipeline.stages.<name>.params``. The builder binds ``params`` to the
    constructor's signature before any weight is read; raise ``ValueError``/``TypeError`` for a bad value and the
    user gets one ``pipeline.stages.<name>.params: ...`` line. Subclass
    :class:`litellm_pipeline.stages.base.Stage` to get ``rt`` stored and the defaults below.

    The builder reads the three class attributes to check the graph before anything runs: every name in
    ``inputs`` must be produced upstream (the engine seeds ``request`` for request-level stages and ``schedule``,
    ``kv_layout`` for step-level ones), request-level stages come first, and some stage must produce ``samples``.
    A stage may also declare ``optional_inputs``: fields it uses when an upstream stage produced them (``emit``
    reads ``text_filters``, see :class:`TextFilter`); producing one only after every stage that reads it is a
    graph error, since nothing would see it.
    """

    level: ClassVar[str]
    """``"request"`` (once per submitted request) or ``"step"`` (once per engine step, over the whole batch)."""
    inputs: ClassVar[tuple[str, ...]]
    """Context fields read, e.g. ``("logits", "sample_requests")``."""
    outputs: ClassVar[tuple[str, ...]]
    """Context fields written; every one of them must be set on the context by every call."""

    def __call__(self, ctx: Any) -> None:
        """Run on one context, under the engine lock.

        * request level: ``ctx`` is a :class:`~litellm_pipeline.stages.base.RequestContext`; ``ctx.request`` is
          not queued yet. Decide and may reject by raising
          :class:`~litellm_pipeline.errors.InvalidRequestError`; anything taken for the request goes into
          ``request.holds`` (cancelled if a later stage rejects, settled when it ends). Never enqueue.
        * step level: ``ctx`` is a :class:`~litellm_pipeline.stages.base.StepContext` with ``schedule``
          (``[(request, num_new_tokens)]`` in row order) and ``kv_layout``; upstream stages add ``route_plan``,
          ``prefill_batch``, ``logits`` (``[R, V]`` float, or None when no row samples), ``sample_requests``
          (the requests sampled; each has one logits row, and ``1 + len(request.draft)`` consecutive rows while
          it verifies a speculative draft: the row of every drafted position and the one after them),
          ``samples`` (``Sample(request, token_id, logprobs)``, in order; a verified request has one per
          accepted draft token and one more) and ``emissions`` (``Emission(request, delta_text, finish_reason,
          text_offset=None)`` per sample of a request until one finishes it: where the token's text starts in
          ``request.text``, None for its end). Transform the context only: never advance
          ``num_computed``, append tokens, finish or free a request (the engine's postprocess does), and keep
          tensors on ``rt.device``. If it raises, the engine restores each request's generator and text and
          retries the step's requests one by one, so a stage must not change request state it cannot undo.
        """


@runtime_checkable
class TextFilter(Protocol):
    """What a step stage between ``sample`` and ``emit`` appends to ``ctx.text_filters`` (a tuple; keep the
    entries already there) to rewrite the text the emit stage shows: redaction, stop phrases, normalisation.

    ``emit`` calls every filter in order for each sampled token, after it extended the request's text with the
    token and applied the request's own stop strings, and before it decides what the stream shows now. The engine
    still appends the token, finishes and frees (a stop ends the request with ``finish_reason="stop"``).
    """

    hold: int
    """How many characters at the end of the text may still change with the next token (e.g. the longest phrase
    minus one): emit holds that much back from the stream until the request finishes."""

    def filter_text(self, request: Request, text: str, start: int) -> tuple[str, bool]:
        """``(new text, stop)`` for ``request`` whose text is now ``text``.

        ``text[:start]`` was shown already and must come back unchanged; rewrite only what follows (it includes
        what was held back in earlier steps, so a phrase split across tokens is seen whole). ``stop=True`` ends the
        request here, with the returned text as its final text. Cheap and side-effect free: it runs per token.
        """


@runtime_checkable
class Attention(Protocol):
    """Kind ``attention``: a function ``(q, k, v, k_cache, v_cache, meta, scale, sliding_window) -> out``.

    Chosen by ``pipeline.stages.decode.params.attention``; called once per decoder layer per step, inside
    ``torch.inference_mode``. The reference is ``sdpa``.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write this step's K/V into the paged cache, then attend every token over its own sequence.

        ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hk, D]`` (``Hq`` a multiple of ``Hk``: grouped-query attention),
        rotated already, activation dtype, on the device. ``k_cache``/``v_cache`` ``[num_blocks * block_size, Hk,
        D]``, same dtype. ``meta``: ``slot_mapping`` ``[T]`` (where token ``t`` writes), ``prefills`` (one
        :class:`~litellm_pipeline.registry.types.SeqAttention` per multi-token entry: its rows and the slots of its
        whole context), and for the one-token entries ``decode_rows`` ``[B]``, ``decode_kv_slots`` ``[B, Lmax]``
        (padded) and ``decode_ctx_lens`` ``[B]``. Returns ``[T, Hq, D]`` in ``q``'s dtype and device.

        Must hold: the cache slots of ``slot_mapping`` hold ``k``/``v`` afterwards; a token sees exactly the
        positions ``<=`` its own of its own sequence (and only the last ``sliding_window`` when that is set);
        a row's result does not depend on the other sequences of the batch (bit for bit when
        ``meta.batch_invariant``); the output matches ``sdpa`` within :data:`REFERENCE_TOLERANCE`.
        """


@runtime_checkable
class MoEDispatch(Protocol):
    """Kind ``moe_dispatch``: a function ``(x, expert_idx, expert_w, w13, w2, ops) -> out``.

    Chosen by ``pipeline.stages.decode.params.moe_dispatch``; called once per MoE layer per step. The reference
    is ``packed``.
    """

    def __call__(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        expert_w: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        ops: LayerOps,
    ) -> torch.Tensor:
        """Run every token through its chosen experts and sum them by their weights.

        ``x`` ``[T, H]`` (activation dtype), ``expert_idx`` ``[T, K]`` long (``-1``: an unused slot, skip it),
        ``expert_w`` ``[T, K]`` float32, ``w13`` ``[E, 2I, H]`` (gate and up stacked), ``w2`` ``[E, H, I]``,
        ``ops`` the model's bound :class:`LayerOps`. Returns ``[T, H]`` in ``x``'s dtype:
        ``sum_k expert_w[t, k] * ops.linear(ops.silu_mul(ops.linear(x[t], w13[e])), w2[e])`` with
        ``e = expert_idx[t, k]``.

        Must hold: a token's result does not depend on which other tokens share the step; it matches
        ``packed`` within :data:`REFERENCE_TOLERANCE`.
        """


@runtime_checkable
class LayerOps(Protocol):
    """Kind ``layer_ops``: the dense projections and small per-layer steps of the decoder.

    Built once by the decode stage as ``cls(**layer_ops_params)``, plus ``deterministic=True`` under
    ``engine.deterministic`` (the batch-invariant mode: a class whose constructor takes no ``deterministic`` is
    refused then); ``layer_ops_params`` is the decode stage's parameter of that name (default none). Bound
    to every layer. Called several times per layer per step, so no host sync and no allocation it can avoid.
    The reference is ``torch``; every method must match it within :data:`REFERENCE_TOLERANCE` on any shape the
    engine passes, and with ``deterministic=True`` a row's result must not depend on the other rows.
    """

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] @ w[O, K]^T (+ bias [O])`` -> ``[M, O]`` in ``x``'s dtype; called with and without ``bias``."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of ``x [..., N]`` with float32 statistics, times ``w [N]``; ``x``'s dtype."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, rms_norm(s, w, eps))`` with ``s = x + residual`` (both ``[T, H]``): a layer's residual and next norm."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a stacked ``[..., 2I]`` projection (gate first) -> ``[..., I]``."""

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (rotate-half form) of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` by ``cos``/``sin`` ``[T, D]``; may work
        in place; returns the rotated ``(q, k)``."""

    def residual_mlp(self, h: torch.Tensor, x: torch.Tensor, mlp: Any) -> torch.Tensor:
        """``h + mlp(x)`` for a dense layer's gated MLP (``mlp.gate_up_proj``, ``mlp.down_proj``); ``[T, H]``."""

    def route(
        self, x: torch.Tensor, gate: torch.Tensor, native_k: int, normalize: bool, plan: RoutePlan | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE block's router: ``(expert_idx [T, K] long, expert_w [T, K] float32)`` from ``linear(x, gate)``.

        Softmax in float32, top-k by a stable sort (ties: the lower expert id), ``K = plan.max_k`` or
        ``native_k``; experts ``plan.allowed[t]`` excludes get no weight, slots past ``plan.top_k[t]`` are ``-1``
        with weight 0; renormalised when ``normalize`` (see ``litellm_pipeline.model.moe.route_tokens``).
        """


class FusedLayerOps(LayerOps, Protocol):
    """Optional :class:`LayerOps` methods the engine uses when present; each may return None to decline, and the
    engine then runs the op-by-op path. Not checked at registration (they are optional)."""

    def prepare_weights(self, model: Any) -> None:
        """Called once by ``CausalLM.bind`` before the ops are bound: convert the weights these ops will read
        (e.g. quantize the projections in place; ``model`` is the loaded ``CausalLM``). Their ``linear`` then
        receives the converted tensors."""

    def weights_moved(self, model: Any) -> None:
        """Called by ``CausalLM.bind`` after it moved the (prepared) weights to new storage (``device.huge_pages``:
        the same Parameter objects, new addresses, the same values): rebuild any state keyed by a weight's
        address (``cpu_int8`` re-registers its scales)."""

    def decode_attention(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Any:
        """A layer's whole attention half for a decode-only step (only bound with ``cpu_paged`` attention):
        ``(s, normed)`` as :meth:`LayerOps.add_rms_norm` would return after the attention, or None."""

    def decode_layers(self, model: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      meta: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      plan: Any, logits: bool = False) -> torch.Tensor | None:
        """Every layer of a decode-only step in one call -> the final hidden states ``[T, H]``, or None; with
        ``logits`` the float32 logits ``[T, V]`` instead (what ``model.compute_logits`` gives of those states)."""

    def moe_experts(self, x: torch.Tensor, expert_idx: torch.Tensor, expert_w: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor | None:
        """The ``fused`` dispatch's whole expert block (same contract as :class:`MoEDispatch`), or None."""


@runtime_checkable
class Router(Protocol):
    """Kind ``router``: turns the TierSets of a step's requests into per-token expert limits.

    Built once by the route stage as ``cls(model_cfg, device, **params)`` (``pipeline.stages.route.params``:
    ``router`` names the entry, the rest are its parameters).
    """

    def plan(self, schedule: list[tuple[Request, int]]) -> RoutePlan | tuple[RoutePlan | None, ...] | None:
        """Once per step, with the step's ``[(request, num_new_tokens)]`` in row order.

        Returns None (every token uses the checkpoint's own routing), one
        :class:`~litellm_pipeline.registry.types.RoutePlan` for all layers, or a tuple with one entry per decoder
        layer. A plan's ``top_k`` is ``[T]`` long (or None: ``max_k`` for every token) and ``allowed`` ``[T, E]``
        bool, on the model's device, with ``T = sum(num_new_tokens)``; ``max_k`` is a plain int (``max(top_k)``).

        Must hold: a token never gets an expert outside its request's ``tierset.allowed_experts`` nor more
        experts than its TierSet's count for that layer, and always at least one; the same schedule always gives the same plan, and a
        token's limits depend only on its own request (routing stays deterministic whatever the batch).
        """


@runtime_checkable
class Sampler(Protocol):
    """Kind ``sampler``: one token per row of logits.

    Built once by the sample stage as ``cls(**params)`` (``pipeline.stages.sample.params`` without ``sampler``);
    raise ``ValueError`` for parameters it does not take.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Once per step that samples, inside ``torch.inference_mode``.

        ``logits`` ``[R, V]`` (float32 or the activation dtype, on the device), ``rows[i]`` the
        :class:`~litellm_pipeline.sampling.samplers.SamplingRow` of row ``i`` (``params``, ``generator``,
        ``prompt_ids``, ``output_ids``). Returns a ``SamplerOutput`` with ``R`` token ids in ``[0, V)`` and
        ``R`` logprobs entries: None when ``params.logprobs`` is None, else ``{token_id: logprob}`` holding at
        least the sampled token and the top ``params.logprobs`` tokens of ``log_softmax`` of the raw logits.

        Must hold: deterministic under a request's seed: every random draw of row ``i`` comes from
        ``rows[i].generator`` (seeded per request; never torch's global RNG), so the same seed gives the same
        tokens whatever else shares the batch; a greedy row (``params.greedy``) takes the argmax (ties: the
        lowest id). The engine restores each generator if the step fails, so drawing is always safe.

        A sampler whose ``__call__`` also takes an ``argmax`` keyword gets, on steps where the decode stage has
        it, each row's first maximum of ``logits`` (a long ``[R]``, NaN counting as the maximum, as
        ``logits.max(-1).indices``), found by the model's fused decode as it wrote the logits; no stage ran
        between the two. Greedy rows may take it instead of searching the logits again.
        """


@runtime_checkable
class Matcher(Protocol):
    """One request's place in its constraint: which tokens may come next. Made by
    :meth:`CompiledConstraint.matcher` when the request is admitted; called by the engine only."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Once per step that samples the request, inside the sample stage: write row ``row`` of ``bitmask``
        (int32 ``[R, ceil(V / 32)]`` on the CPU), every word of it: bit ``t % 32`` of word ``t // 32`` set
        means token ``t`` may come next. End-of-sequence tokens are set only where the output may end."""

    def accept(self, token: int) -> bool:
        """Once per sampled token, in the engine's postprocess (after every stage of the step succeeded):
        advance past ``token``; False if the constraint does not allow it (the engine then fails the request)."""

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (the engine takes back tokens it did not keep)."""

    def is_terminated(self) -> bool:
        """True once the output is complete (an end-of-sequence token was accepted): the request finishes."""


@runtime_checkable
class CompiledConstraint(Protocol):
    """What :meth:`Constraint.compile` returns: cached by the engine and shared by every request with the
    same spec, so it must not hold per-request state."""

    def matcher(self) -> Matcher:
        """A fresh :class:`Matcher` at the start of the output (once per admitted request)."""


@runtime_checkable
class Constraint(Protocol):
    """Kind ``constraint``: a kind of structured output, chosen per request as ``constraint={NAME: value}``
    (on the server also ``response_format``, ``structured_outputs`` and ``tools``).

    Built once per engine, on first use, as ``cls(grammars)``: ``grammars`` is the engine's
    :class:`~litellm_pipeline.constraints.grammar.Grammars` (xgrammar over the checkpoint's vocabulary), whose
    ``json_schema``, ``regex`` and ``ebnf`` methods return ready compiled constraints.
    """

    def compile(self, value: Any) -> CompiledConstraint:
        """A request's value (plain JSON data) compiled. Runs on a compile thread, off the step loop, once per
        distinct value (the engine caches by a hash of kind and value) and within
        ``structured_output.compile_timeout_s``. Raise ``ValueError`` saying what is wrong with ``value``: the
        request is refused with that message (HTTP 400)."""


@runtime_checkable
class Proposer(Protocol):
    """Kind ``proposer``: speculative decoding's drafts (``speculative.method``; its ``speculative.params`` are
    the constructor's keyword arguments).

    Built once per engine as ``cls(rt, **params)`` (``rt``: the engine's
    :class:`~litellm_pipeline.engine.runtime.Runtime`); raise ``ValueError`` for parameters or a model it cannot
    work with. A proposer only proposes: the engine verifies every drafted token with one forward of the request's
    own model and keeps it only where the target would have produced it, so a bad draft costs time, never
    correctness. Optional: ``fill(requests)``, for a proposer that drafts with the target's KV cache (``tier``):
    called after the scheduler grew each request's KV blocks for its draft, it overwrites the tokens of every
    ``request.draft`` and may shorten it (never lengthen it); the K/V it writes at the drafted positions are
    overwritten by verification. ``release(request)``: the request ended (free what is kept for it). The time
    ``propose`` and ``fill`` take is measured: the engine's adaptive drafting weighs it, with the verified rows,
    against the tokens a draft is expected to add. ``draft_price`` (a ``Price``, default None): what a drafted
    token costs at list price, for ``CostRecord.speculation_monetary``. ``free`` (default False): True for a
    proposer whose ``propose`` costs next to nothing (a lookup, no model, no ``fill``); the engine then also asks
    it for requests that do not draft and scores what they generate against its answer (a shadow draft), so their
    acceptance stays known without verifying rows.
    """

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Sequence[Sequence[int]]:
        """Once per step, before scheduling, for the running requests that may draft (their known tokens all
        computed but the last): up to ``ks[i]`` token ids to follow ``requests[i]``'s prompt and output (read,
        never change, the request), fewer or none where it has nothing worth verifying."""


@runtime_checkable
class KVPolicy(Protocol):
    """Kind ``kv_policy``: which cached-but-unused KV block to give up first (``cache.kv_policy``).

    Built as ``cls()``, one per block pool (the hot pool, and the warm pool when ``cache.warm_blocks`` > 0).
    It tracks the pool's *evictable* blocks: blocks holding a cached prompt prefix that no request references.
    Block ids are ints in ``[0, num_blocks)``. Every method runs on the step path (allocation happens while the
    scheduler plans a step), so each must be O(1) or O(log n).

    Must hold: :meth:`pop` returns only a block added and not removed since, so a policy never evicts a block in
    use; ``len`` is exact (the pool counts ``free = never-cached + len(policy)``); at the end of a run with every
    request finished the pool is empty again.
    """

    def add(self, block: int) -> None:
        """The block's last reference was dropped and it holds a cached prefix: it is evictable from now on."""

    def remove(self, block: int) -> None:
        """The block is in use again (a prefix hit) or discarded: never return it from :meth:`pop` until the next
        :meth:`add`. A block that is not tracked is a no-op."""

    def hit(self, block: int) -> None:
        """A request reused the block's cached content (after :meth:`remove` when it was evictable); frequency
        or cost-aware policies count it here."""

    def forget(self, block: int) -> None:
        """The block's content is gone (evicted, discarded, or the cache reset): drop any history kept for it."""

    def pop(self) -> int | None:
        """Choose the victim among the tracked blocks, stop tracking it and return it; None only when empty."""

    def __len__(self) -> int:
        """The number of tracked (evictable) blocks; exact, since the pool's free count is built on it."""

    def __contains__(self, block: object) -> bool:
        """Whether the block is tracked (the pool asks before it discards or resets a cached block)."""


class DescribedKVPolicy(KVPolicy, Protocol):
    """The optional :class:`KVPolicy` hook the block pool calls when present (cost-aware policies use it). Not
    checked at registration (it is optional)."""

    def describe(self, block: int, depth: int, parent: int | None) -> None:
        """A block (in use) has just been cached as link ``depth`` (1: a prompt's first block) of a prefix chain
        whose previous link is cached in block ``parent`` (None for the first): how much a later hit on it saves.
        Called once per newly cached block, before it can become evictable."""


@runtime_checkable
class BudgetSolver(Protocol):
    """Kind ``budget_solver``: the best TierSet (one expert count per layer) that fits a request's budget.

    Built as ``cls()`` once per engine by the select_tier stage (``budget.solver``).
    """

    def solve(self, problem: Problem) -> Solution | None:
        """Once per admitted request in the budgeted modes, under the engine lock.

        ``problem`` (:class:`~litellm_pipeline.budget.solvers.Problem`): per layer a tuple of
        ``Option(k, costs, value)``, ``limits`` (one per cost, None: unlimited) and ``base_costs``. Returns a
        ``Solution(choice, costs, value)`` with one option index per layer, or None.

        Must hold: a returned solution fits (``problem.fits(solution.costs)``) and its costs and value are
        ``problem.evaluate(solution.choice)``'s; None only when even the cheapest choice
        (``problem.cheapest()``) does not fit; the same problem always gives the same answer. ``exact`` is
        optimal; another solver may return less value, and says so with ``Solution(..., exact=False)``.
        """


@runtime_checkable
class Scheduler(Protocol):
    """Kind ``scheduler``: which requests compute how many tokens each step (``engine.scheduler``).

    Built once as ``cls(kv, max_num_seqs, max_num_batched_tokens, preemption, bus=bus)`` (``kv``: the
    :class:`~litellm_pipeline.engine.kv_cache_manager.KVCacheManager`; ``preemption``: ``"recompute"`` or
    ``"swap"``; ``bus``: the :class:`~litellm_pipeline.telemetry.bus.EventBus`), plus ``weights={tenant: share}``
    when the constructor has a ``weights`` parameter, and ``kv_shares={tenant: (max_kv_fraction,
    min_kv_fraction)}`` when tenants set KV shares (a scheduler that takes no ``kv_shares`` is then a config
    error; FcfsScheduler keeps them). Subclass
    :class:`litellm_pipeline.engine.scheduler.FcfsScheduler` and change its ordering (``add``, ``requeue``,
    ``victim``) rather than starting from nothing: it already grows, preempts and frees KV correctly.

    The scheduler alone owns a request's place in the queues and its KV from ``add`` to ``finish``: nothing else
    reads or changes its queues; whoever must judge the load (the admit stage's queue quota, select_tier's batch
    and wait estimates, step telemetry) asks :meth:`load`.
    """

    def add(self, req: Request) -> None:
        """A request passed every request-level stage: queue it."""

    def schedule(self) -> list[tuple[Request, int]]:
        """Once per engine step: ``[(request, num_new_tokens)]``, each request at most once, ``n >= 1`` and at
        most its ``num_scheduled_tokens - num_computed`` (the known tokens and a speculative ``draft``), at most
        ``max_num_seqs`` entries and ``max_num_batched_tokens`` tokens in all. A running request's draft is
        scheduled whole or not at all: where it does not fit the budget or the free blocks, clear ``request.draft``
        and ``kv.trim`` the request instead of preempting anyone. Every entry's KV blocks are grown through ``kv``
        to hold ``num_computed + n`` tokens before it is returned; a request preempted to make room has its draft
        cleared, its KV freed or swapped and is queued again. An empty list means nothing can run now (the
        engine then asks :meth:`blocked`)."""

    def postprocess(self, schedule: list[tuple[Request, int]]) -> None:
        """After the step's stages ran: advance every entry's ``num_computed`` by its ``n`` (for a speculating
        request, the engine passes the tokens verification kept), commit its KV through ``kv`` (newly full
        blocks become replayable prefixes) and ``kv.trim`` it (blocks that held only rejected tokens go back)."""

    def load(self) -> SchedulerLoad:
        """A snapshot of the queues: running and waiting requests (in order) and ``max_num_seqs``."""

    def blocked(self) -> tuple[Request, str] | None:
        """After an empty schedule: the waiting request that can never start and why (the engine ends it with
        that error), or None when waiting is enough."""

    def finish(self, req: Request) -> None:
        """The request ended (finished, aborted or failed): take it out of ``running`` or ``waiting`` and give
        its KV back through ``kv`` (commit, then free). Must hold for a request in either queue; once every
        request is finished the block pool is empty."""

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running (front ends step the engine until it is not)."""


@runtime_checkable
class TelemetrySink(Protocol):
    """Kind ``telemetry``: a subscriber of the event bus (``telemetry.sinks``).

    Built once as ``cls(**params)`` with ``telemetry.params.<name>``.
    """

    def publish(self, event: Event) -> None:
        """Every event (:mod:`litellm_pipeline.telemetry.events`), synchronously, inside the engine step under
        the engine lock. Must be quick, must not block or call back into the engine, and must not raise (an
        exception would fail the step's requests)."""


@dataclass(frozen=True)
class Interface:
    """A kind's protocol and how the engine builds its entries (what :mod:`~litellm_pipeline.registry.conformance`
    verifies at registration)."""

    kind: str
    protocol: type
    function: bool = False  # entries are plain functions called with the protocol's __call__ arguments
    built_as: str = "cls()"  # how the engine builds an entry (messages and the listing)
    build_args: int | None = None  # positional arguments the engine always passes; None: not checked
    build_kwargs: tuple[str, ...] = ()  # keyword arguments the engine always passes
    build_exact: bool = False  # True: nothing else is ever passed, so every other parameter needs a default
    build_kwargs_if_accepted: tuple[str, ...] = ()  # passed only when the constructor has such a parameter
    optional: type | None = None  # a protocol of optional methods (documentation only)

    @property
    def qualname(self) -> str:
        return f"{self.protocol.__module__}.{self.protocol.__qualname__}"


INTERFACES: Mapping[str, Interface] = {
    i.kind: i
    for i in (
        Interface("stage", PipelineStage, built_as="cls(rt, **params)", build_args=1),
        Interface("attention", Attention, function=True,
                  built_as="fn(q, k, v, k_cache, v_cache, meta, scale, sliding_window)"),
        Interface("moe_dispatch", MoEDispatch, function=True, built_as="fn(x, expert_idx, expert_w, w13, w2, ops)"),
        Interface("layer_ops", LayerOps, built_as="cls(**layer_ops_params[, deterministic=True])", build_args=0,
                  build_exact=True,
                  optional=FusedLayerOps),
        Interface("router", Router, built_as="cls(model_cfg, device, **params)", build_args=2),
        Interface("sampler", Sampler, built_as="cls(**params)"),
        Interface("kv_policy", KVPolicy, build_args=0, build_exact=True, optional=DescribedKVPolicy),
        Interface("budget_solver", BudgetSolver, build_args=0, build_exact=True),
        Interface("scheduler", Scheduler,
                  built_as="cls(kv, max_num_seqs, max_num_batched_tokens, preemption, bus=bus[, weights=...])",
                  build_args=4, build_kwargs=("bus",), build_exact=True, build_kwargs_if_accepted=("weights",)),
        Interface("telemetry", TelemetrySink, built_as="cls(**params)"),
        Interface("constraint", Constraint, built_as="cls(grammars)", build_args=1),
        Interface("proposer", Proposer, built_as="cls(rt, **params)", build_args=1),
    )
}

