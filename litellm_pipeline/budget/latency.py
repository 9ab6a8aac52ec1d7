"""LatencyTracker: keeps the cost model's latency predictions current from what requests and steps actually took.

A sink on the event bus (subscribed by the select_tier stage in the modes that decide by predicted latency):
for every finished request it folds ``actual / predicted`` end-to-end and inter-token latency (predicted by the
cost model itself: a request's prediction was corrected by the factors of its time, which are divided out) into an
exponentially weighted mean (in log space, each observation clipped to 1/20..20 so a cold start or one
stall cannot swamp it), per TierSet and decode-batch bucket and per bucket over all TierSets; and every
engine step's duration into a :class:`~litellm_pipeline.budget.step_model.StepModel` (a line in decode rows
and prefill tokens), which is known long before the first request under a new load finishes. The selector
multiplies its predictions by these factors (and by measured / predicted step time where that is larger).
"""

from __future__ import annotations

import math
import threading
import time

from litellm_pipeline.budget.step_model import StepModel
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
        self._steps = StepModel()  # measured engine step times
        # wall time from one step's end to the next one's over the step itself, while the engine has work:
        # what admitting (and refusing) requests and the serving loop add to every step a request waits through
        self._duty = _Ewma()
        self._last_end: float | None = None  # perf_counter at the end of the last step that left work pending
        self.version = 0  # grows with every measurement (what a reader caches on it is stale once it changed)
        self._lock = threading.Lock()

    def publish(self, event: Event) -> None:
        if type(event) is StepFinished:
            now = time.perf_counter()
            with self._lock:
                self.version += 1
                if event.decode_tokens or event.prefill_tokens:
                    self._steps.add(event.decode_tokens, event.prefill_tokens, event.duration_s * 1e3)
                    if self._last_end is not None and event.duration_s > 0:
                        self._duty.add(max(1.0, (now - self._last_end) / event.duration_s), 0.5 * self.alpha)
                self._last_end = now if event.num_running + event.num_waiting else None
            return
        if type(event) is not RequestCosted:
            return
        b = bucket(event.batch)
        f, g = event.correction  # measured against the cost model's own prediction, not the corrected one
        with self._lock:
            self.version += 1
            for table, actual, pred in ((self._e2e, event.latency_ms, event.predicted_latency_ms / f),
                                        (self._tok, event.per_token_ms, event.predicted_per_token_ms / g)):
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

    def step_ms(self, batch: int, prefill_tokens: int = 0) -> float | None:
        """The measured time of an engine step with ``batch`` decode rows (and ``prefill_tokens`` prompt tokens),
        from the line fitted through the recent steps; None before any step was measured."""
        with self._lock:
            ms = self._steps.predict(batch, prefill_tokens)
            return None if ms is None else ms * self._duty.factor

    def prefill_ms(self, tokens: int) -> float | None:
        """What prefilling ``tokens`` prompt tokens adds to a step, measured (None before a step prefilled
        anything)."""
        with self._lock:
            ms = self._steps.prefill_ms(tokens)
            return None if ms is None else ms * self._duty.factor

    def observations(self, tier: str | None, batch: int) -> int:
        e = self._e2e.get((tier, bucket(batch)))
        return e.n if e is not None else 0
