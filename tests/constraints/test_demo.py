"""The embedded demo model under constraints: its skills answer inside a given shape (digits, a choice), and a
shape its 47-token vocabulary cannot write (JSON needs braces and quotes) is refused at once, naming why."""

from __future__ import annotations

import pytest

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.demo import demo_prompts
from litellm_pipeline.errors import InvalidRequestError


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(overrides=["device.threads=1"])


def test_the_demo_model_answers_in_the_shape_asked(demo):
    add = [ex for ex in demo_prompts(0) if ex.task == "add"][0]
    (free,) = demo.generate([add.prompt], SamplingParams(temperature=0, max_tokens=8))
    (digits,) = demo.generate([add.prompt], SamplingParams(temperature=0, max_tokens=8),
                              constraint={"regex": "[0-9]{1,4}"})
    assert digits.text == free.text == add.answer and digits.finish_reason == "stop"
    wrong = str(int(add.answer) + 1)
    (picked,) = demo.generate([add.prompt], SamplingParams(temperature=0, max_tokens=8),
                              constraint={"choice": [wrong, add.answer]})
    assert picked.text == add.answer  # the model's own answer, among the allowed ones
    # a shape around the answer: the model fills the digits it knows
    (shaped,) = demo.generate([add.prompt], SamplingParams(temperature=0, max_tokens=12),
                              constraint={"grammar": 'root ::= "sum " [0-9]+'})
    assert shaped.text.startswith("sum ") and shaped.finish_reason == "stop"


def test_json_on_the_demo_vocabulary_is_refused_naming_why(demo):
    with pytest.raises(InvalidRequestError, match="constraint.json_object: allows no token this model's vocabulary"):
        demo.generate(["12+3="], SamplingParams(max_tokens=8), constraint={"json_object": True})
    (ok,) = demo.generate(["12+3="], SamplingParams(temperature=0, max_tokens=4))
    assert ok.text == "15"  # the engine goes on serving
