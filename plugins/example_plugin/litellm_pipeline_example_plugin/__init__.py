"""Example litellm_pipeline plugin.

Entry points (see ``pyproject.toml``):

* ``litellm_pipeline.plugins``: ``example_plugin = litellm_pipeline_example_plugin:register`` adds the
  step-level stage ``ban_tokens`` (:class:`~litellm_pipeline_example_plugin.ban_tokens.BanTokens`).
* ``litellm_pipeline.sampler``: ``example_argmax`` (:class:`~litellm_pipeline_example_plugin.sampler.ArgmaxSampler`),
  imported only when a config asks for it.
"""

from __future__ import annotations

from litellm_pipeline import registry
from litellm_pipeline_example_plugin.ban_tokens import BanTokens

__all__ = ["BanTokens", "register"]

# (kind, name, object) this plugin adds eagerly
ENTRIES = (("stage", "ban_tokens", BanTokens),)


def register() -> None:
    """Add this plugin's entries to the registry.

    Idempotent: ``registry.load_plugins(force=True)`` calls it again, and registering the same object
    twice must not turn into a duplicate-name error (which would report this plugin as broken). A
    *different* object under one of these names is still a genuine clash and raises.
    """
    for kind, name, obj in ENTRIES:
        try:
            registry.add(kind, name, obj)
        except registry.RegistryError:
            if registry.get(kind, name) is not obj:
                raise
