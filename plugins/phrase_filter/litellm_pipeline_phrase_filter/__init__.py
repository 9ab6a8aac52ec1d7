"""A text filter stage for litellm_pipeline (registry kind ``stage``, name ``phrase_filter``): masks configured
words in the streamed and final text and ends a request when a stop phrase appears.

Registered through the lazy entry point group ``litellm_pipeline.stage`` (see ``pyproject.toml``).
"""

from litellm_pipeline_phrase_filter.stage import PhraseFilter

__all__ = ["PhraseFilter"]
