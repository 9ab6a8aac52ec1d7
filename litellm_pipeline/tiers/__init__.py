"""Tiers: how much of a Mixture-of-Experts model a request may spend.

* :class:`TierSet` — the expert choices one request may use (experts per token, optionally which experts).
* :func:`resolve_tiers` — the configured tiers (``conf/tiers``) in terms of one checkpoint.
* :class:`BudgetSpec` — a request's limits (latency, money); budget solvers (registry kind
  ``budget_solver``) pick the TierSet that fits a budget.

Routing and the select_tier stage read plain frozen values from here; nothing in this package touches
the per-token path.
"""

from litellm_pipeline.tiers.budget import BudgetSpec
from litellm_pipeline.tiers.tierset import TierSet, resolve_tiers

__all__ = ["BudgetSpec", "TierSet", "resolve_tiers"]
