"""Per-request sampling parameters, validated at the edge (request admission).

``SamplingParams`` is a frozen pydantic model: after validation the engine only reads plain
attributes. Any invalid value raises a ``ValueError`` whose text has one line per problem, naming
the field and the allowed range, e.g. ``temperature: must be >= 0 and <= 100 (got -1)``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field

from litellm_pipeline.errors import ReadableModel, range_message

__all__ = ["SamplingParams"]

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts


def _in_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
              extra_ok: tuple[Any, ...] = (), extra_text: str = "") -> AfterValidator:
    """An after-validator whose message states the whole range, not only the violated bound."""
    text = (f"must be {extra_text} or " + range_message(lo, hi, lo_open=lo_open)[len("must be "):]
            if extra_text else range_message(lo, hi, lo_open=lo_open))

    def check(v: Any) -> Any:
        if v is None or v in extra_ok:
            return v
        ok = not (isinstance(v, float) and not math.isfinite(v))  # nan/inf pass comparisons oddly
        if ok and lo is not None:
            ok = v > lo if lo_open else v >= lo
        if ok and hi is not None:
            ok = v <= hi
        if not ok:
            raise ValueError(text)
        return v

    return AfterValidator(check)


def _str_to_list(v: Any) -> Any:
    # OpenAI accepts ``stop: "###"`` as well as a list
    return [v] if isinstance(v, str) else v


def _non_empty(v: str) -> str:
    if v == "":
        raise ValueError("must not be an empty string")
    return v


def _reject_bool(v: Any) -> Any:
    # pydantic's lax mode would read True as 1; a bool for a number is a client bug
    if isinstance(v, bool):
        raise ValueError("must be a number, not a bool")
    return v


# limits that keep one request from stalling the engine (stop strings are searched every step under its lock)
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 1024

_NUM = BeforeValidator(_reject_bool)
_StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH), AfterValidator(_non_empty)]
_TokenId = Annotated[int, _NUM, _in_range(0)]


class SamplingParams(ReadableModel):
    """How to pick tokens for one request (OpenAI / vLLM semantics).

    * ``temperature`` 0 means greedy (argmax; ties go to the lowest token id).
    * ``top_k`` 0 or -1 disables top-k; ``top_p`` 1 and ``min_p`` 0 disable theirs.
    * ``repetition_penalty`` (HF): over prompt + output tokens, positive logits are divided by it,
      negative ones multiplied. ``presence_penalty`` / ``frequency_penalty`` (OpenAI): over generated
      tokens, ``logit -= presence * (count > 0) + frequency * count``.
    * ``logprobs`` None returns none; ``n`` returns the sampled token's logprob plus the top ``n``.
    * ``seed`` makes the request's tokens reproducible regardless of the rest of the batch.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    max_tokens: Annotated[int, _NUM, _in_range(1)] = 16
    temperature: Annotated[float, _NUM, _in_range(0, 100)] = 1.0
    top_k: Annotated[int, _NUM, _in_range(1, extra_ok=(0, -1), extra_text="0 or -1 (disabled)")] = 0
    top_p: Annotated[float, _NUM, _in_range(0, 1, lo_open=True)] = 1.0
    min_p: Annotated[float, _NUM, _in_range(0, 1)] = 0.0
    repetition_penalty: Annotated[float, _NUM, _in_range(0, lo_open=True)] = 1.0
    presence_penalty: Annotated[float, _NUM, _in_range(-2, 2)] = 0.0
    frequency_penalty: Annotated[float, _NUM, _in_range(-2, 2)] = 0.0
    seed: Annotated[int | None, _NUM, _in_range(_SEED_MIN, _SEED_MAX)] = None
    stop: Annotated[list[_StopString], BeforeValidator(_str_to_list), Field(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[_TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    logprobs: Annotated[int | None, _NUM, _in_range(0, 20)] = None
    skip_special_tokens: bool = True

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "SamplingParams":
        """A copy; changed fields are validated like the constructor's (pydantic's own copy skips that)."""
        if update:
            return type(self).model_validate({**self.model_dump(), **update})
        return super().model_copy(deep=deep)

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0)."""
        return self.temperature == 0
