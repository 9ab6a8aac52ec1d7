"""Built-in pipeline stages; importing this package registers them."""

from litellm_pipeline.stages import (  # noqa: F401
    admit,
    decode,
    emit,
    prefill,
    route,
    sample,
    select_tier,
)
from litellm_pipeline.stages.base import RequestContext, Stage, StepContext

__all__ = ["Stage", "RequestContext", "StepContext"]
