"""phrase_filter: a step stage between ``sample`` and ``emit`` that masks configured words and ends requests at
stop phrases.

Place it after ``sample`` and before ``emit``, the stage that turns sampled tokens into text and proposes finishes::

    +pipeline.stages.filter={impl: phrase_filter, params: {redact: [secret], stop: ["END"]}}
    'pipeline.order=[admit,select_tier,route,prefill,decode,sample,filter,emit]'

Before emit there is no text yet, only token ids, so the stage hands emit a text filter
(:class:`litellm_pipeline.registry.interfaces.TextFilter`) through ``ctx.text_filters``: emit extends each request's text
with its new token, applies the request's own stop strings, then this filter, and holds back the characters the
filter may still change. Appending tokens, finishing and freeing stay the engine's postprocess, so a stop phrase
ends a request exactly as a stop string does (``finish_reason="stop"``, blocks freed) and the token limits hold
whatever this stage says. Placed after emit, the builder refuses the graph (emit would never see the filter).

* **redact**: every occurrence is replaced by ``mask`` characters, one per character, so the text keeps its length.
  A word split across tokens is caught because the last ``len(longest) - 1`` characters are held back until the
  next token shows whether they start a word.
* **stop**: the text is cut where the first stop phrase begins and the request finishes with "stop" (the phrase
  itself is not shown, as with stop strings).
"""

from __future__ import annotations

import re
from typing import Sequence

from litellm_pipeline.stages.base import Stage, StepContext


def _phrases(key: str, value) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{key}: must be a list of strings (got {value!r})")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"{key}: every entry must be a non-empty string (got {bad})")
    return tuple(value)


def _pattern(words: tuple[str, ...], flags: int) -> re.Pattern | None:
    # longest first: at one position the longest phrase wins
    return re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)), flags) if words else None


class PhraseFilter(Stage):
    level = "step"
    inputs = ("samples",)
    outputs = ("text_filters",)
    # what ``pytest --litellm-conformance`` passes check_stage: words to mask and a phrase to stop at
    conformance = {"params": {"redact": ["secret", "ell"], "stop": ["7"]}}

    def __init__(self, rt, redact: Sequence[str] = (), stop: Sequence[str] = (), mask: str = "*",
                 ignore_case: bool = False):
        super().__init__(rt)
        redact, stop = _phrases("redact", redact), _phrases("stop", stop)
        if not isinstance(mask, str) or len(mask) != 1:
            raise ValueError(f"mask: must be one character, so masked text keeps its length (got {mask!r})")
        if not isinstance(ignore_case, bool):
            raise ValueError(f"ignore_case: must be true or false (got {ignore_case!r})")
        flags = re.IGNORECASE if ignore_case else 0
        self._redact, self._stop, self._mask = _pattern(redact, flags), _pattern(stop, flags), mask
        # a phrase is found only once whole: this much text may still be the start of one
        self.hold = max((len(p) for p in (*redact, *stop)), default=1) - 1

    def __call__(self, ctx: StepContext) -> None:
        filters = getattr(ctx, "text_filters", ())
        if ctx.samples and (self._redact is not None or self._stop is not None):
            filters = (*filters, self)
        ctx.text_filters = filters

    def filter_text(self, request, text: str, start: int) -> tuple[str, bool]:
        """Cut ``text`` at the first stop phrase after ``start`` and mask the redacted words after ``start``."""
        stop = False
        if self._stop is not None:
            m = self._stop.search(text, start)
            if m is not None:
                text, stop = text[: m.start()], True
        if self._redact is not None:
            mask = self._mask
            text = text[:start] + self._redact.sub(lambda m: mask * len(m.group()), text[start:])
        return text, stop
