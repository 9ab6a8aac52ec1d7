"""The data the contracts (:mod:`~litellm_pipeline.registry.interfaces`) speak of, beside them: what an engine step
hands the model, what a sampler gets and returns, what a budget solver is asked and answers.

Plain dataclasses with no behaviour beyond reading themselves; implementations import them from here. This module
imports nothing of the package and not torch (tensors are only annotated), so the contracts load with the
registry for the price of a few classes.

The step's attention inputs: the engine packs every scheduled token of every request (prefill chunks and decode
tokens) into one flat batch of ``T`` tokens. The KV cache of each layer is a flat tensor of
``num_blocks * block_size`` slots; ``slot_mapping[t]`` is where token ``t`` writes its K/V, and each sequence
reads its whole context back through the slots of its block table. Everything here is built once per step and
shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Sequence

if TYPE_CHECKING:
    import torch

    from litellm_pipeline.engine.request import Request
    from litellm_pipeline.sampling.params import SamplingParams

__all__ = ["SeqAttention", "AttentionMetadata", "RoutePlan", "SamplingRow", "SamplerOutput", "Option", "Problem",
           "Solution", "SchedulerLoad", "Event"]


# ---- one engine step (kinds attention, moe_dispatch, layer_ops, router)
@dataclass
class SeqAttention:
    """One sequence whose new tokens are attended on their own (prefill chunks, or any q_len > 1)."""

    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # number of new tokens this step
    ctx_len: int  # tokens in its KV after this step (cached + new)
    kv_slots: torch.Tensor  # [ctx_len] long: flat KV slot of every context position


@dataclass
class AttentionMetadata:
    """Attention inputs of one step. Sequences with one new token form the batched decode group."""

    slot_mapping: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    prefills: list[SeqAttention]
    decode_rows: torch.Tensor | None = None  # [B] long: rows of the flat batch that are decode tokens
    decode_kv_slots: torch.Tensor | None = None  # [B, Lmax] long, padded with 0
    decode_ctx_lens: torch.Tensor | None = None  # [B] long
    batch_invariant: bool = False  # engine.deterministic: every row's arithmetic independent of the others
    _decode_masks: dict = field(default_factory=dict, repr=False)

    @property
    def decode_only(self) -> bool:
        """Every token of the step is a sequence's next token (no prompt chunk)."""
        return not self.prefills and self.decode_rows is not None

    def decode_mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, 1, Lmax]: 0 where a decode token may attend, -inf elsewhere (cached per window)."""
        key = (sliding_window, dtype)
        m = self._decode_masks.get(key)
        if m is None:
            assert self.decode_kv_slots is not None and self.decode_ctx_lens is not None
            import torch  # already loaded: a step has tensors

            lmax = self.decode_kv_slots.shape[1]
            kpos = torch.arange(lmax, device=self.decode_kv_slots.device)[None, :]
            lens = self.decode_ctx_lens[:, None]
            ok = kpos < lens
            if sliding_window is not None:
                ok &= kpos > (lens - 1 - sliding_window)
            m = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))[:, None, None, :]
            self._decode_masks[key] = m
        return m


@dataclass
class RoutePlan:
    """Per-token MoE routing limits for one step, derived from each request's TierSet.

    ``top_k[t]`` is how many experts token ``t`` may use (``None``: the checkpoint's own top-k for every
    token); ``allowed[t, e]`` is False for experts outside the token's TierSet (``None``: all allowed).
    ``max_k`` is the largest entry of ``top_k`` (a plain int, so no host sync is needed per layer).
    """

    top_k: torch.Tensor | None = None  # [T] long
    max_k: int | None = None
    allowed: torch.Tensor | None = None  # [T, E] bool


# ---- sampling (kind sampler)
@dataclass
class SamplingRow:
    """What the sampler needs about one request for this step (row ``i`` of the logits)."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded from params.seed; None for greedy (or: use torch's global RNG)
    prompt_ids: Sequence[int] | torch.Tensor  # for the repetition penalty
    output_ids: Sequence[int] | torch.Tensor  # tokens generated so far (all penalties)


@dataclass
class SamplerOutput:
    """One token id per row, and per row the logprobs dict (``{token id: logprob}``) or None."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


# ---- budgets (kind budget_solver): a multiple-choice knapsack, one choice of option per layer
@dataclass(frozen=True)
class Option:
    k: int  # the expert count this option stands for
    costs: tuple[float, ...]  # one per constraint of the problem
    value: float


@dataclass(frozen=True)
class Problem:
    layers: tuple[tuple[Option, ...], ...]  # the options of each layer
    limits: tuple[float | None, ...]  # per constraint: the most the summed costs may be (None: no limit)
    base_costs: tuple[float, ...] = ()  # costs outside the layers, counted against the limits

    def __post_init__(self) -> None:
        n = len(self.limits)
        if any(not opts for opts in self.layers):
            raise ValueError("every layer needs at least one option")
        if any(len(o.costs) != n for opts in self.layers for o in opts):
            raise ValueError(f"every option needs {n} costs, one per limit")
        if self.base_costs and len(self.base_costs) != n:
            raise ValueError(f"base_costs needs {n} entries, one per limit")

    def base(self) -> tuple[float, ...]:
        return self.base_costs or (0.0,) * len(self.limits)

    def fits(self, costs: tuple[float, ...]) -> bool:
        return all(lim is None or c <= lim * (1 + 1e-12) for c, lim in zip(costs, self.limits))

    def evaluate(self, choice: tuple[int, ...]) -> Solution:
        costs = list(self.base())
        value = 0.0
        for opts, i in zip(self.layers, choice):
            o = opts[i]
            costs = [c + d for c, d in zip(costs, o.costs)]
            value += o.value
        return Solution(tuple(choice), tuple(costs), value)

    def cheapest(self) -> Solution:
        """The cheapest option in every layer (by the sum of its costs scaled by the limits)."""
        scale = self._scales()
        choice = tuple(min(range(len(opts)), key=lambda i: (_norm(opts[i].costs, scale), -opts[i].value))
                       for opts in self.layers)
        return self.evaluate(choice)

    def _scales(self) -> tuple[float, ...]:
        out = []
        for j, lim in enumerate(self.limits):
            if lim is not None and lim > 0:
                out.append(1.0 / lim)
            else:
                top = sum(max(o.costs[j] for o in opts) for opts in self.layers)
                out.append(1.0 / top if top > 0 else 0.0)
        return tuple(out)


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per layer: the index of the chosen option
    costs: tuple[float, ...]
    value: float
    exact: bool = True  # False: the exact solver had to thin its partial solutions (see ExactSolver)

    def ks(self, problem: Problem) -> tuple[int, ...]:
        return tuple(opts[i].k for opts, i in zip(problem.layers, self.choice))


def _norm(costs: tuple[float, ...], scale: tuple[float, ...]) -> float:
    return sum(c * s for c, s in zip(costs, scale))


# ---- telemetry (kind telemetry_sink): every event is a frozen record of this base (litellm_pipeline.telemetry.events)
@dataclass(frozen=True, slots=True)
class Event:
    kind: ClassVar[str] = "event"


# ---- scheduling (kind scheduler)
@dataclass(frozen=True)
class SchedulerLoad:
    """What a scheduler holds at one moment (``Scheduler.load()``), for whoever must judge the load: the tier
    selector's batch and wait estimates, tenant queue quotas, step telemetry. Tuples: a reader cannot change the
    queues, which only the scheduler does."""

    running: tuple[Request, ...]  # holding KV, scheduled every step
    waiting: tuple[Request, ...]  # queued, in the order they will start
    max_num_seqs: int  # the most requests in one step

    @property
    def in_flight(self) -> tuple[Request, ...]:
        return self.running + self.waiting

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens not computed yet, over every request in flight."""
        return sum(max(0, len(r.prompt_ids) - r.num_computed) for r in self.running + self.waiting)
