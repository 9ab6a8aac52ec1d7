"""``ngram`` proposer: prompt lookup. The last n tokens are looked up among the request's earlier tokens (prompt
and output, the most recent occurrence first); what followed them there is the draft. Free to compute, and
right wherever the output repeats its context: copying, quoting, editing code, structured data."""

from __future__ import annotations

from array import array
from typing import Sequence

from litellm_pipeline.engine.request import Request
from litellm_pipeline.registry import register

_ITEM = array("i").itemsize


@register("proposer", "ngram")
class NgramProposer:
    """``max_n``/``min_n``: the longest and shortest suffix looked up (longest first)."""

    free = True  # a lookup: the speculator may ask it for requests that do not draft, to keep their acceptance known

    def __init__(self, rt=None, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"speculative.params: need 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        self.max_n, self.min_n = max_n, min_n
        self._seqs: dict[int, tuple[Request, array]] = {}  # id(request) -> its tokens so far, as int32

    def _tokens(self, req: Request) -> array:
        kept = self._seqs.get(id(req))
        if kept is None or kept[0] is not req:
            if len(self._seqs) > 4096:  # requests that ended: their entries go (recent ones are rebuilt cheaply)
                self._seqs.clear()
            buf = array("i", req.prompt_ids)
            self._seqs[id(req)] = (req, buf)
        else:
            buf = kept[1]
        n = len(buf) - len(req.prompt_ids)
        if n < len(req.output_ids):
            buf.extend(req.output_ids[n:])
        return buf

    def release(self, req: Request) -> None:
        """The request ended: its tokens go (the speculator calls this when it finishes, however it ends)."""
        self._seqs.pop(id(req), None)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        return [self.lookup(self._tokens(r), k) for r, k in zip(reqs, ks)]

    def lookup(self, tokens: array, k: int) -> list[int]:
        """The ``k`` tokens after the most recent earlier occurrence of the longest suffix found (or none)."""
        size = len(tokens)
        data = tokens.tobytes()
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            pattern = data[(size - n) * _ITEM :]
            end = (size - 1) * _ITEM  # a match must end before the last token: something follows it
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:
                    start = at // _ITEM + n
                    return tokens[start : start + k].tolist()
                end = at + len(pattern) - 1  # straddles two tokens: look further back
        return []
