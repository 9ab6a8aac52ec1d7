"""Budgets: how much one request may spend, and the choice of the TierSet that fits.

* :class:`BudgetSpec` (:mod:`~litellm_pipeline.budget.spec`) — a request's limits (latency, money) and the
  :class:`~litellm_pipeline.budget.spec.CostRecord` every finished request carries.
* :mod:`~litellm_pipeline.budget.solvers` — budget solvers (registry kind ``budget_solver``): the best TierSet
  per problem; their problem and solution types live beside the contracts (:mod:`litellm_pipeline.registry.types`).
* :mod:`~litellm_pipeline.budget.selector` — :class:`~litellm_pipeline.budget.selector.TierSetSelector`, the
  modes (fixed, balanced, deep, max) behind the select_tier stage.
* :mod:`~litellm_pipeline.budget.latency` and :mod:`~litellm_pipeline.budget.step_model` — what a step costs:
  the live latency tracker and the fitted step-time model the selector predicts with.

What a TierSet is and what it costs per token live in :mod:`litellm_pipeline.tiers`.
"""

from litellm_pipeline.budget.spec import BudgetSpec

__all__ = ["BudgetSpec"]
