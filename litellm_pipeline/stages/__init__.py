"""Built-in pipeline stages; importing this package registers them."""

from litellm_pipeline.stages import admit, decode, emit, prefill, route, sample, select_tier  # noqa: F401
from litellm_pipeline.stages.base import RequestContext, Stage, StepContext

__all__ = ["Stage", "RequestContext", "StepContext"]
