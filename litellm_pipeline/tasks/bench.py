"""``+recipe=bench``: the engine against transformers (and llama.cpp's server, when present) and this machine's
roofline; the machinery lives in :mod:`litellm_pipeline.bench`."""

from __future__ import annotations


def run(cfg) -> dict:
    from litellm_pipeline.bench import run_bench

    return run_bench(cfg)
