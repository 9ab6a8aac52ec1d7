"""Plugin stages the server tests put into the pipeline by config (``impl: server_stages:Name``)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from litellm_pipeline.stages.base import Stage, StepContext

MARKER = "boom"  # a prompt holding this text fails inside the engine


class FailOnMarker(Stage):
    """Raises while sampling for any request whose prompt holds :data:`MARKER`: the engine retries a failing
    step's requests one by one, so only that request fails."""

    level = "step"
    inputs = ("samples",)
    outputs = ()

    def __call__(self, ctx: StepContext) -> None:
        tok = self.rt.tokenizer
        for req, _, _ in ctx.samples:
            if MARKER in tok.decode(req.prompt_ids):
                raise RuntimeError(f"injected plugin fault for {req.request_id}")


class SlowSteps(Stage):
    """Sleeps ``delay_s`` per engine step, so a request of a few tokens stays in flight long enough for a test
    to act while it runs (the demo model's steps take about a millisecond)."""

    level = "step"
    inputs = ("samples",)
    outputs = ()

    def __init__(self, rt, delay_s: float = 0.05):
        super().__init__(rt)
        self.delay_s = delay_s

    def __call__(self, ctx: StepContext) -> None:
        time.sleep(self.delay_s)


@contextlib.contextmanager
def slow_steps(server, delay_s: float) -> Iterator[SlowSteps]:
    """The server's SlowSteps stage sleeps ``delay_s`` per step inside the block; steps are quick again after it."""
    stage = server.stage(SlowSteps)
    stage.delay_s = delay_s
    try:
        yield stage
    finally:
        stage.delay_s = 0.0
