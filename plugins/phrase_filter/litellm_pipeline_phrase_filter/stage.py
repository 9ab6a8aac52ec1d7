"""phrase_filter: a step stage after ``emit`` that masks configured words and ends requests at stop phrases.

Place it after ``emit``, the stage that turns sampled tokens into text and proposes finishes::

    +pipeline.stages.filter={impl: phrase_filter, params: {redact: [secret], stop: ["END"]}}
    'pipeline.order=[admit,select_tier,route,prefill,decode,sample,emit,filter]'

Why after emit and not between sample and emit: before emit a stage sees token ids only, and emit writes
``ctx.emissions`` afresh, so an earlier stage could neither read the text nor ask for a finish. After it, this stage
rewrites what emit proposed and nothing else: the text not shown yet, the delta shown now and the finish asked for.
Appending tokens, finishing and freeing stay the engine's postprocess, so a stop phrase ends a request exactly as a
stop string does (``finish_reason="stop"``, blocks freed) and the token limits hold whatever this stage says.

* **redact**: every occurrence is replaced by ``mask`` characters, one per character, so the text keeps its length
  and emit's bookkeeping (``emitted_chars``) stays valid. A word split across tokens is caught because the last
  ``len(longest) - 1`` characters are held back until the next token shows whether they start a word.
* **stop**: the text is cut where the first stop phrase begins and the request finishes with "stop" (the phrase
  itself is not shown, as with stop strings).

Put it last in the order: if a later stage raised in the same step, the engine would put back the text's length
but not the characters masked in the held-back tail.
"""

from __future__ import annotations

import re
from typing import Sequence

from litellm_pipeline.engine.request import Emission
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
    inputs = ("emissions",)
    outputs = ("emissions",)

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
        self._hold = max((len(p) for p in (*redact, *stop)), default=1) - 1

    def __call__(self, ctx: StepContext) -> None:
        if self._redact is None and self._stop is None:
            return
        ctx.emissions = [self._filter(e) for e in ctx.emissions]

    def _filter(self, e: Emission) -> Emission:
        req = e.request
        start = req.emitted_chars - len(e.delta_text)  # everything before was shown in earlier steps
        text, reason = req.text, e.finish_reason
        if self._stop is not None:
            m = self._stop.search(text, start)
            if m is not None:
                text, reason = text[: m.start()], "stop"
        if self._redact is not None:
            mask = self._mask
            text = text[:start] + self._redact.sub(lambda m: mask * len(m.group()), text[start:])
        req.text = text
        if reason is None:  # hold back what may still become a phrase, and whatever emit held back
            upto = min(req.emitted_chars, max(start, len(text) - self._hold))
        else:
            upto = len(text)
        req.emitted_chars = upto
        return e._replace(delta_text=text[start:upto], finish_reason=reason)
