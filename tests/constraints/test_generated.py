"""Hypothesis-generated JSON schemas and regexes on a random-weight model: nothing but the constraint can make
the output valid, and every output validates (``jsonschema``, ``re.fullmatch``), greedy and sampled, batched with
free requests. The schemas bound every length (strings, arrays, integer ranges) so each output ends within
``max_tokens``: a cut-short output would prove nothing either way."""

from __future__ import annotations

import json
import re

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hf_models import random_prompts

from litellm_pipeline import SamplingParams
from litellm_pipeline.request_spec import RequestSpec

_NAME = st.text(alphabet="abcdefgh_", min_size=1, max_size=4)
_WORD = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters='"\\'),
                min_size=1, max_size=4)

_LEAF = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 500)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 4)),
    st.lists(_WORD, min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
    _WORD.map(lambda w: {"const": w}),
)


def _object(props: dict, required_mask: int) -> dict:
    names = sorted(props)
    required = [n for i, n in enumerate(names) if required_mask >> i & 1 or i == 0]
    return {"type": "object", "properties": props, "required": required}


SCHEMAS = st.recursive(_LEAF, lambda inner: st.one_of(
    st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
              inner, st.integers(0, 1), st.integers(0, 2)),
    st.builds(_object, st.dictionaries(_NAME, inner, min_size=1, max_size=3), st.integers(0, 7)),
    st.lists(inner, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts}),
), max_leaves=6)

_ATOM = st.one_of(
    st.sampled_from(["[a-z]", "[0-9]", "[A-F0-9]", "\\d", "[^\\s]", "[ab]", "x", "é", "-", "\\.", "[xyz]"]),
)
_PIECE = st.builds(lambda atom, rep: atom + rep, _ATOM,
                   st.sampled_from(["", "?", "{2}", "{1,3}", "{0,2}"]))
REGEXES = st.recursive(
    st.lists(_PIECE, min_size=1, max_size=4).map("".join),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(lambda alts: "(" + "|".join(alts) + ")"),
        st.lists(inner, min_size=2, max_size=3).map("".join),
        inner.map(lambda r: "(" + r + "){1,2}"),
    ), max_leaves=5)

_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _batch(llm, constraint, seed: int):
    prompts = random_prompts([5 + seed % 7, 9, 6], seed=seed)
    return llm.generate([
        RequestSpec(prompts[0], SamplingParams(temperature=0, max_tokens=400), constraint=constraint),
        RequestSpec(prompts[1], SamplingParams(temperature=1.0, seed=seed, max_tokens=400), constraint=constraint),
        RequestSpec(prompts[2], SamplingParams(temperature=0.8, seed=seed, max_tokens=6, ignore_eos=True)),
    ])


def _check_batch(llm, constraint, seed: int, valid) -> None:
    """The constrained requests (greedy, sampled) end and pass ``valid``; the free one is as if alone."""
    greedy, sampled, free = _batch(llm, constraint, seed)
    for out in (greedy, sampled):
        assert out.finish_reason == "stop", (constraint, out.text)
        valid(out.text)
    assert free.finish_reason == "length" and len(free.token_ids) == 6


@_SETTINGS
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_generated_schemas_always_validate(tiny, schema, seed):
    _check_batch(tiny, {"json_schema": schema}, seed, lambda text: jsonschema.validate(json.loads(text), schema))


@_SETTINGS
@given(pattern=REGEXES, seed=st.integers(0, 2**16))
def test_generated_regexes_always_match(tiny, pattern, seed):
    def valid(text: str) -> None:
        assert re.fullmatch(pattern, text), (pattern, text)

    _check_batch(tiny, {"regex": pattern}, seed, valid)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_generated_schemas_stream_to_valid_json(tiny, schema, seed):
    text = "".join(d.text for d in tiny.stream(random_prompts([7], seed=seed)[0],
                                                SamplingParams(temperature=1.0, seed=seed, max_tokens=400),
                                                constraint={"json_schema": schema}))
    jsonschema.validate(json.loads(text), schema)
