"""The seeded workload: random byte-token prompts and output lengths, uniform in the given ranges."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

# the byte tokenizer's ids: 0..2 are <s>, </s>, <pad>; byte b is 3 + b
FIRST_BYTE_ID, LAST_BYTE_ID = 3, 258
PAD_ID = 2


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: tuple[int, ...]
    output_len: int  # tokens wanted (generated with ignore_eos)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(FIRST_BYTE_ID, LAST_BYTE_ID) for _ in range(n)]


def make_workload(num_requests: int, prompt_len: Sequence[int], output_len: Sequence[int], seed: int) -> list[WorkItem]:
    """``num_requests`` items; lengths uniform in the inclusive ranges; the same seed, the same items."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        p = rng.randint(prompt_len[0], prompt_len[1])
        o = rng.randint(output_len[0], output_len[1])
        items.append(WorkItem(tuple(random_ids(rng, p)), o))
    return items


def batch1_item(prompt_len: int, output_len: int, seed: int) -> WorkItem:
    """The single request of the batch-1 decode measurement."""
    rng = random.Random(seed ^ 0xB1)
    return WorkItem(tuple(random_ids(rng, prompt_len)), output_len)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(ttft: Sequence[float], tpot: Sequence[float]) -> dict:
    """TTFT / TPOT p50 and p99 in milliseconds."""
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)),
        "tpot_ms_p99": ms(percentile(tpot, 99)),
    }
