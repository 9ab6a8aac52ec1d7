"""Helpers of the structured-output tests (imported as a plain module: ``tests/constraints`` is on sys.path)."""

from __future__ import annotations

from litellm_pipeline import LLM


def pool_empty(llm: LLM) -> None:
    pool = llm.engine.rt.pool
    assert pool.is_empty() and not any(pool.ref_counts), f"{pool.num_blocks - pool.num_free} KV blocks still held"
    assert not llm.engine.requests and not llm.engine.has_unfinished()
