"""A Lagrangian-relaxation budget solver for litellm_pipeline (registry kind ``budget_solver``, name ``lagrangian``).

Registered through the lazy entry point group ``litellm_pipeline.budget_solver`` (see ``pyproject.toml``): nothing is
imported until a config says ``budget.solver=lagrangian``.
"""

from litellm_pipeline_lagrangian_solver.solver import LagrangianSolver

__all__ = ["LagrangianSolver"]
