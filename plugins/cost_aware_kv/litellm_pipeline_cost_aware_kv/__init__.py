"""A cost-aware KV eviction policy for litellm_pipeline (registry kind ``kv_policy``, name ``recompute_cost``).

Registered through the lazy entry point group ``litellm_pipeline.kv_policy`` (see ``pyproject.toml``): nothing is
imported until a config says ``cache.kv_policy=recompute_cost``.
"""

from litellm_pipeline_cost_aware_kv.policy import RecomputeCostPolicy

__all__ = ["RecomputeCostPolicy"]
