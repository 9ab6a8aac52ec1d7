"""``+recipe=serve``: the OpenAI-compatible HTTP server (see :mod:`litellm_pipeline.server`); runs until SIGTERM or
SIGINT drains it."""

from __future__ import annotations

from litellm_pipeline.tasks import app_config


def run(cfg) -> None:
    from litellm_pipeline.server.serve import serve

    serve(app_config(cfg))
