"""SamplingParams validation: one readable line per bad field, naming the allowed range."""

from __future__ import annotations

import pydantic
import pytest

from litellm_pipeline.errors import format_validation_error
from litellm_pipeline.sampling import SamplingParams

# ---------------------------------------------------------------- validation

BAD = [
    ("max_tokens", 0, ">= 1"),
    ("temperature", -1, ">= 0 and <= 100"),
    ("temperature", 101, ">= 0 and <= 100"),
    ("temperature", float("nan"), ">= 0 and <= 100"),
    ("top_k", -2, ">= 1"),
    ("top_p", 0.0, "> 0 and <= 1"),
    ("top_p", 1.5, "> 0 and <= 1"),
    ("min_p", -0.1, ">= 0 and <= 1"),
    ("min_p", 1.1, ">= 0 and <= 1"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, ">= -2 and <= 2"),
    ("frequency_penalty", -3, ">= -2 and <= 2"),
    ("seed", 2**70, "<= 18446744073709551615"),
    ("stop", [""], "empty"),
    ("stop", "", "empty"),
    ("stop_token_ids", [-1], ">= 0"),
    ("logprobs", 21, ">= 0 and <= 20"),
    ("logprobs", -1, ">= 0 and <= 20"),
    ("ignore_eos", "maybe", "bool"),
    ("skip_special_tokens", "maybe", "bool"),
    ("temperature", True, "not a bool"),
]


@pytest.mark.parametrize("field,value,range_text", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_invalid_value_names_field_and_range(field, value, range_text):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    msg = str(exc.value)
    assert msg.startswith(field), msg
    assert range_text in msg, msg
    assert "\n" not in msg  # one problem -> one line


def test_exact_message_and_model_validate():
    with pytest.raises(ValueError, match=r"^temperature: must be >= 0 and <= 100 \(got -1\)$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError) as exc:
        SamplingParams.model_validate({"temperature": -1, "bogus": 1})
    assert str(exc.value).splitlines() == ["temperature: must be >= 0 and <= 100 (got -1)", "bogus: unknown key (got 1)"]


def test_valid_values_and_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.logprobs) == (16, 1.0, 0, 1.0, 0.0, None)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    with pytest.raises((TypeError, ValueError)):
        p.temperature = 0.3  # frozen


def test_format_validation_error_nested_paths():
    class Inner(pydantic.BaseModel):
        size: int = pydantic.Field(ge=1)

    class Outer(pydantic.BaseModel):
        items: list[Inner]
        params: SamplingParams

    with pytest.raises(pydantic.ValidationError) as exc:
        Outer.model_validate({"items": [{"size": 1}, {"size": 0}], "params": {"top_p": 2}})
    lines = format_validation_error(exc.value, "cfg").splitlines()
    assert lines == ["cfg.items[1].size: must be >= 1 (got 0)", "cfg.params.top_p: must be > 0 and <= 1 (got 2)"]


def test_stop_limits_name_the_limit():
    from litellm_pipeline.sampling.params import (
        MAX_STOP_LENGTH,
        MAX_STOP_STRINGS,
        MAX_STOP_TOKEN_IDS,
    )

    with pytest.raises(ValueError, match=rf"^stop: must have at most {MAX_STOP_STRINGS} item"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=rf"^stop\[1\]: must have at most {MAX_STOP_LENGTH} character"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_LENGTH + 1)])
    with pytest.raises(ValueError, match=rf"^stop_token_ids: must have at most {MAX_STOP_TOKEN_IDS} item"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert len(SamplingParams(stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS


def test_model_copy_validates_its_update():
    p = SamplingParams(max_tokens=4)
    assert p.model_copy(update={"max_tokens": 9}) == SamplingParams(max_tokens=9)
    assert p.model_copy() == p
    with pytest.raises(ValueError, match=r"^logprobs: must be >= 0 and <= 20 \(got 1000\)$"):
        p.model_copy(update={"logprobs": 1000})
    with pytest.raises(ValueError, match="nonsense: unknown key"):
        p.model_copy(update={"nonsense": 1})


def test_request_spec_revalidates_params_built_without_validation():
    from litellm_pipeline import RequestSpec
    from litellm_pipeline.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"^params: logprobs: must be >= 0 and <= 20 \(got 1000\)$"):
        RequestSpec([1, 2], SamplingParams.model_construct(logprobs=1000))
