"""LatencyTracker: keeps the cost model's latency predictions current from what requests and steps actually took.

A sink on the event bus (subscribed by the select_tier stage in the modes that decide by predicted latency):
for every finished request it folds ``actual / predicted`` end-to-end and inter-token latency into an
exponentially weighted mean (in log space, each observation clipped to 1/20..20 so a cold start or one
stall cannot swamp it), per TierSet and decode-batch bucket and per bucket over all TierSets; and for every
engine step its duration per batch bucket, which is known long before the first request under a new load
finishes. The selector multiplies its predictions by these factors (and by measured / predicted step time
where that is larger).
"""

from __future__ import annotations

import math
import threading

from litellm_pipeline.telemetry.events import Event, RequestCosted, StepFinished

_CLIP = math.log(20.0)


def bucket(batch: int) -> int:
    """Decode batch sizes in powers of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, (max(1, batch) - 1).bit_length())


class _Ewma:
    __slots__ = ("log", "n")

    def __init__(self) -> None:
        self.log, self.n = 0.0, 0

    def add(self, ratio: float, alpha: float) -> None:
        x = max(-_CLIP, min(_CLIP, math.log(ratio)))
        # the first observations weigh more (a plain mean until 1/alpha of them)
        a = max(alpha, 1.0 / (self.n + 1))
        self.log += a * (x - self.log)
        self.n += 1

    @property
    def factor(self) -> float:
        return math.exp(self.log)


class LatencyTracker:
    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self._e2e: dict[tuple[str | None, int], _Ewma] = {}
        self._tok: dict[tuple[str | None, int], _Ewma] = {}
        self._steps: dict[int, _Ewma] = {}  # measured engine step time (ms, log space) per batch bucket
        self._lock = threading.Lock()

    def publish(self, event: Event) -> None:
        if type(event) is StepFinished:
            if event.decode_tokens and event.batch_size:
                with self._lock:
                    step = self._steps.setdefault(bucket(event.batch_size), _Ewma())
                    step.add(max(event.duration_s * 1e3, 1e-3), self.alpha)
            return
        if type(event) is not RequestCosted:
            return
        b = bucket(event.batch)
        with self._lock:
            for table, actual, pred in ((self._e2e, event.latency_ms, event.predicted_latency_ms),
                                        (self._tok, event.per_token_ms, event.predicted_per_token_ms)):
                if actual is None or actual <= 0 or pred <= 0:
                    continue
                for key in ((event.tier, b), (None, b)):
                    table.setdefault(key, _Ewma()).add(actual / pred, self.alpha)

    def factors(self, tier: str | None, batch: int) -> tuple[float, float]:
        """(end-to-end, inter-token) correction for ``tier`` at ``batch``: its own, else its bucket's over all
        TierSets, else the nearest bucket seen (a larger one on a tie: what the first requests measured is a
        better guess for an unseen batch size than the uncorrected estimate), else 1."""
        b = bucket(batch)
        with self._lock:
            out = []
            for table in (self._e2e, self._tok):
                e = table.get((tier, b)) or table.get((None, b))
                if e is None:
                    seen = [k[1] for k in table if k[0] is None]
                    if seen:
                        near = min(seen, key=lambda s: (abs(s.bit_length() - b.bit_length()), -s))
                        e = table[(None, near)]
                out.append(e.factor if e is not None else 1.0)
        return out[0], out[1]

    def step_ms(self, batch: int) -> float | None:
        """The measured time of an engine step with ``batch`` requests (its bucket, else the nearest bucket seen,
        a larger one on a tie), or None before any step was measured. Steps that also prefill other requests'
        prompts count too: under load that is what a decode step costs."""
        b = bucket(batch)
        with self._lock:
            if not self._steps:
                return None
            near = b if b in self._steps else min(self._steps, key=lambda s: (abs(s.bit_length() - b.bit_length()), -s))
            return self._steps[near].factor  # exp of the mean log: a geometric mean of the step times

    def observations(self, tier: str | None, batch: int) -> int:
        e = self._e2e.get((tier, bucket(batch)))
        return e.n if e is not None else 0
