"""StepModel: an engine step's duration as a line in the work it holds, fitted online.

``ms = a + b * decode_rows + c * prefill_tokens + d * [any prefill in the step]``. A continuous-batching step
costs a fixed part (per-step framework work), a part per decode row, a part per prompt token prefilled in it,
and, when it prefills anything at all, the extra of a mixed step (a decode-only step runs every layer in one
fused call; a step with prompt chunks runs layer by layer). Fitting that line by exponentially weighted
least squares over the steps the engine just ran gives what a step costs at a batch size not seen yet (the
batch a new request would make) and what a newcomer's prefill adds to the requests in flight, and it follows
the machine as it gets busier. Where the steps seen do not tell two terms apart, a small ridge (relative to
each term's own scale) pulls the slope to zero, so an unmeasured batch takes the measured mean: never below
what was seen. Slopes are kept >= 0: a step never gets cheaper with more work in it.
"""

from __future__ import annotations

import numpy as np

# features in comparable ranges (keeps the system well conditioned)
_SCALE = np.array((1.0, 64.0, 1024.0, 1.0))
_RIDGE = 1e-4  # relative to each slope's own sum of squares (scale-free)


class StepModel:
    def __init__(self, decay: float = 0.98):
        self.decay = decay  # weight of the past per new step: ~1 / (1 - decay) steps of memory
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._n = 0
        self._coef: tuple[float, ...] | None = None

    @property
    def steps(self) -> int:
        return self._n

    @property
    def saw_prefill(self) -> bool:
        return bool(self._xx[3, 3] > 0)

    def add(self, decode_rows: int, prefill_tokens: int, ms: float) -> None:
        x = np.array((1.0, decode_rows, prefill_tokens, 1.0 if prefill_tokens else 0.0)) / _SCALE
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * ms
        self._n += 1
        self._coef = None

    def coef(self) -> tuple[float, float, float, float] | None:
        """(fixed ms, ms per decode row, ms per prefill token, ms extra for a step with a prefill), or None
        before any step."""
        if self._n == 0:
            return None
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def predict(self, decode_rows: int, prefill_tokens: int = 0) -> float | None:
        c = self.coef()
        if c is None:
            return None
        return max(1e-3, c[0] + c[1] * decode_rows + c[2] * prefill_tokens + (c[3] if prefill_tokens else 0.0))

    def prefill_ms(self, tokens: int) -> float | None:
        """What prefilling ``tokens`` prompt tokens adds to a step (None before a step prefilled anything)."""
        c = self.coef()
        if c is None or not self.saw_prefill:
            return None
        return c[2] * tokens + c[3]

    def _fit(self) -> tuple[float, ...]:
        keep = [0, 1, 2, 3]
        while True:
            idx = np.array(keep)
            xx = self._xx[np.ix_(idx, idx)]
            a = xx + np.diag([0.0] + [_RIDGE * xx[i, i] for i in range(1, len(keep))])
            theta = np.linalg.lstsq(a, self._xy[idx], rcond=None)[0]
            neg = [k for k, t in zip(keep[1:], theta[1:]) if t < 0]
            if not neg:
                break
            keep.remove(neg[0])  # a negative slope is noise: drop that term and fit again
        full = np.zeros(4)
        full[idx] = theta
        return tuple(float(v) for v in full / _SCALE)
