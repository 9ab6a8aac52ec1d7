"""Streaming detokenization: the text of generated tokens as they come, never half a character."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from litellm_pipeline.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of generated tokens, never emitting half-made characters.

    Each step decodes a short window of recent output tokens twice, without and with the new ones (vLLM's
    prefix_offset/read_offset), and emits the difference. Decoding a window rather than single tokens keeps
    sentencepiece word-boundary spaces ('▁') and multi-token UTF-8 sequences (byte-level BPE, <0xE2> byte-fallback)
    right; a window whose text ends in U+FFFD is held back until the character completes.

    The window covers output tokens only, never the prompt, so `text` equals tokenizer.decode(output_ids) exactly
    (e.g. the first word loses its sentencepiece leading space just as in a full decode). Call `flush()` at the end to
    release a trailing incomplete character, which a full decode renders as U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.num_prompt_tokens = len(prompt_ids)  # kept for callers' bookkeeping; text never depends on the prompt
        self.output_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: first token whose text is not yet known to be final context
        self._read_offset = 0  # tokens before this have been emitted
        # of the text the last add() returned, how many characters came from tokens held back before it (a
        # byte that was not yet a whole character): the new token's own text starts that far into it
        self.last_lead = 0

    def add(self, token_id: int) -> str:
        """Append one generated token and return the newly completed text (possibly "")."""
        self.output_ids.append(token_id)
        self.last_lead = 0
        return self._emit(final=False)

    @property
    def holding(self) -> bool:
        """Whether tokens added are held back (their text ends in part of a character): the next text that
        comes out carries theirs."""
        return self._read_offset < len(self.output_ids)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete trailing character) once generation has ended."""
        return self._emit(final=True)

    def checkpoint(self) -> tuple[int, int, int, int]:
        """The streaming state, to :meth:`rollback` to if the step that adds tokens is undone."""
        return len(self.output_ids), len(self.text), self._prefix_offset, self._read_offset

    def rollback(self, cp: tuple[int, int, int, int]) -> None:
        n, t, self._prefix_offset, self._read_offset = cp
        del self.output_ids[n:]
        self.text = self.text[:t]

    def _emit(self, final: bool) -> str:
        ids = self.output_ids
        prefix_text = self._tok.decode(ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(prefix_text):]
        if not final and self._read_offset < len(ids) - 1:  # held tokens come out with this one
            held = self._tok.decode(ids[self._prefix_offset:-1], self._skip)[len(prefix_text):]
            self.last_lead = len(os.path.commonprefix([held, delta]))
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self.text += delta
        return delta
