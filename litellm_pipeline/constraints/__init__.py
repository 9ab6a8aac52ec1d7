"""Structured output: constraints that decide which tokens a request may write next.

A request names one constraint kind and its value (:mod:`~litellm_pipeline.constraints.spec`); the engine's
:class:`~litellm_pipeline.constraints.compiler.ConstraintCompiler` compiles it off the step loop (cached, bounded
in time and size); the request's matcher masks its logits row in the sample stage
(:mod:`~litellm_pipeline.constraints.masking`) and advances with every token the engine keeps. Built-in kinds
(:mod:`~litellm_pipeline.constraints.kinds`): ``json_schema``, ``json_object``, ``regex``, ``choice``,
``grammar``, compiled by xgrammar (:mod:`~litellm_pipeline.constraints.grammar`); plugins add kinds under the
registry kind ``constraint``.
"""

from litellm_pipeline.constraints.compiler import ConstraintCompiler, ConstraintSettings
from litellm_pipeline.constraints.spec import ConstraintSpec, to_constraint

__all__ = ["ConstraintSpec", "to_constraint", "ConstraintCompiler", "ConstraintSettings"]
