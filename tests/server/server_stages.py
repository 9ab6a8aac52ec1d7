"""Plugin stages the server tests put into the pipeline by config (``impl: server_stages:Name``)."""

from __future__ import annotations

import time

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
