"""From YAML to a running engine: everything that touches Hydra, OmegaConf or pydantic config lives here.

* :mod:`~litellm_pipeline.config.compose` — ``conf/`` and ``recipes/`` composed by Hydra (``+recipe=NAME``),
  for the command line and for tests.
* :mod:`~litellm_pipeline.config.schema` — the pydantic model of the whole config: one message with the key path
  and the allowed range for a bad value.
* :mod:`~litellm_pipeline.config.build` — the builder: validates the stage graph once and turns the config into
  plain objects (model, KV cache, scheduler, stages, engine). Nothing after it sees a config object.
"""
