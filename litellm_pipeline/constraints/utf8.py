"""Utf8Guard: which tokens of a byte vocabulary keep an output valid UTF-8, per UTF-8 decoder state.

xgrammar checks the characters of a grammar, but its byte automaton lets some invalid sequences through (a
surrogate's bytes, or F0 followed by 80): a byte-level model could write them, and the text would then hold U+FFFD
replacements, breaking a string's length limit. :class:`~litellm_pipeline.constraints.grammar.GrammarMatcher`
narrows each mask with the guard's row for its state and advances the state with every accepted token.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["Utf8Guard"]

# The UTF-8 decoder's states between tokens: 0 = at a character boundary; the others wait for continuation bytes
# (1, 2 or 3 of 80..BF; or after E0, ED, F0, F4 a first continuation byte of a narrower range).
_UTF8_LEAD = {**{b: 0 for b in range(0x80)}, **{b: 1 for b in range(0xC2, 0xE0)}, 0xE0: 4,
              **{b: 2 for b in range(0xE1, 0xF0) if b != 0xED}, 0xED: 5, 0xF0: 6,
              **{b: 3 for b in range(0xF1, 0xF4)}, 0xF4: 7}
_UTF8_CONT = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2), 4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1),
              6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
_UTF8_STATES = 8


def _utf8_step(state: int, data: bytes) -> int:
    """The decoder's state after ``data`` from ``state``; -1 if ``data`` is not valid UTF-8 there."""
    for b in data:
        if state == 0:
            state = _UTF8_LEAD.get(b, -1)
        else:
            lo, hi, nxt = _UTF8_CONT[state]
            state = nxt if lo <= b <= hi else -1
        if state < 0:
            return -1
    return state


class Utf8Guard:
    """Per decoder state, the bitmask of tokens that continue valid UTF-8 (``masks``, xgrammar's layout) and the
    state each token leads to (``step``); built once per vocabulary (only tokens past ASCII need the walk)."""

    def __init__(self, decoded: Sequence[bytes], stop_ids: Sequence[int], vocab_size: int):
        import numpy as np

        words = (vocab_size + 31) // 32
        nxt = np.full((_UTF8_STATES, vocab_size), -1, dtype=np.int8)
        stops = set(stop_ids)
        for t, data in enumerate(decoded[:vocab_size]):
            if t in stops:
                nxt[0, t] = 0  # the output may end only at a character boundary
            elif not data:
                nxt[:, t] = np.arange(_UTF8_STATES)  # writes nothing (the grammar decides about it)
            elif max(data) < 0x80:
                nxt[0, t] = 0
            else:
                for state in range(_UTF8_STATES):
                    nxt[state, t] = _utf8_step(state, data)
        allowed = np.zeros((_UTF8_STATES, words * 32), dtype=bool)
        allowed[:, :vocab_size] = nxt >= 0
        bits = (allowed.reshape(_UTF8_STATES, words, 32).astype(np.int64) << np.arange(32)).sum(-1)
        self.masks = torch.from_numpy(bits.astype(np.uint32).view(np.int32))  # [states, words], xgrammar's layout
        self.next = nxt.tolist()

    def step(self, state: int, token: int) -> int:
        return self.next[state][token]
