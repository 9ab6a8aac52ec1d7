"""Tiers: how much of a Mixture-of-Experts model a request may spend.

* :class:`TierSet` — the expert choices one request may use (experts per token, optionally which experts).
* :func:`resolve_tiers` — the configured tiers (``conf/tiers``) in terms of one checkpoint.
* :mod:`~litellm_pipeline.tiers.cost_model` — what a TierSet costs (latency, money) and is worth (quality).
* :mod:`~litellm_pipeline.tiers.router` — routers (registry kind ``router``): each step's RoutePlan from the
  scheduled requests' TierSets.

Which TierSet a request gets under its budget is decided in :mod:`litellm_pipeline.budget`. Routing and the
select_tier stage read plain frozen values from here; nothing in this package touches the per-token path.
"""

from litellm_pipeline.tiers.tierset import TierSet, resolve_tiers

__all__ = ["TierSet", "resolve_tiers"]
