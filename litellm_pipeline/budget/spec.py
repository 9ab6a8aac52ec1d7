"""BudgetSpec: the limits one request may spend (all optional; an empty spec means no limit), and the CostRecord
every finished request carries."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Mapping

from pydantic import ConfigDict, Field

from litellm_pipeline.errors import ReadableModel

_Limit = Annotated[float | None, Field(default=None, gt=0, allow_inf_nan=False)]


class BudgetSpec(ReadableModel):
    """A request's budget.

    * ``latency_cost_ms`` — end-to-end latency (arrival to last token).
    * ``latency_per_token_ms`` — inter-token latency.
    * ``monetary_cost_units`` — money for the whole request, in the units of the tier prices.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    latency_cost_ms: _Limit = None
    latency_per_token_ms: _Limit = None
    monetary_cost_units: _Limit = None

    @property
    def unlimited(self) -> bool:
        return self.latency_cost_ms is None and self.latency_per_token_ms is None and self.monetary_cost_units is None

    def limits(self) -> tuple[float | None, float | None, float | None]:
        """(latency_cost_ms, latency_per_token_ms, monetary_cost_units), in that order."""
        return self.latency_cost_ms, self.latency_per_token_ms, self.monetary_cost_units

    def kept(self, latency_ms: float | None, per_token_ms: float | None, monetary: float | None) -> dict[str, bool]:
        """Per set limit: whether the value kept it (an unmeasured value, None, counts as kept)."""
        values = (latency_ms, per_token_ms, monetary)
        return {name: v is None or v <= lim * (1 + 1e-9)
                for name, v, lim in zip(LIMITS, values, self.limits()) if lim is not None}


LIMITS = ("latency_cost_ms", "latency_per_token_ms", "monetary_cost_units")  # BudgetSpec's fields, in order


@dataclass(frozen=True)
class CostRecord:
    """What a finished request was planned to cost and what it cost: the TierSet it ran at, predicted and
    actual latency and money, and per set budget limit whether the actual value kept it."""

    tier: str
    experts_per_layer: tuple[int, ...]
    mode: str  # the select_tier mode that chose it
    cost_model: str  # "analytic" or the profile it was predicted from
    feasible: bool  # False: nothing fitted the budget and the cheapest TierSet ran (on_infeasible=cheapest)
    predicted_latency_ms: float
    predicted_per_token_ms: float
    predicted_monetary: float
    predicted_quality: float
    latency_ms: float | None = None
    per_token_ms: float | None = None
    monetary: float | None = None
    budget: BudgetSpec | None = None
    budget_met: Mapping[str, bool] = field(default_factory=dict)
    # speculative decoding: tokens drafted for it and kept, and the list price of the work that is not in its
    # output (verified tokens that were rejected, at its tier's output price; a tier draft's tokens at the draft
    # tier's): reported, not charged (``monetary`` is the output's price)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    speculation_monetary: float = 0.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["experts_per_layer"] = list(self.experts_per_layer)
        d["budget"] = self.budget.model_dump(exclude_none=True) if self.budget is not None else None
        d["budget_met"] = dict(self.budget_met)
        return d
