"""BudgetSpec: the limits one request may spend. All limits are optional; an empty spec means no limit."""

from __future__ import annotations

from typing import Annotated

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
