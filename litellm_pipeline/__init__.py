"""litellm_pipeline: an LLM inference runtime whose whole structure is declared in Hydra YAML."""

from litellm_pipeline.budget.spec import BudgetSpec
from litellm_pipeline.registry import register
from litellm_pipeline.request_spec import RequestSpec
from litellm_pipeline.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestSpec", "BudgetSpec", "register", "StreamDelta"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model core; importing the package for its registry stays cheap
    if name in ("LLM", "StreamDelta"):
        from litellm_pipeline import llm

        return getattr(llm, name)
    raise AttributeError(name)
