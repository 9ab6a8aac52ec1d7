"""ConstraintSpec: the one-key mapping every front end passes, canonicalised and checked for shape."""

from __future__ import annotations

import pytest

from litellm_pipeline.constraints import ConstraintSpec, to_constraint
from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.request_spec import RequestSpec


def test_mapping_becomes_a_spec_and_json_text_is_parsed():
    a = to_constraint({"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'})
    b = to_constraint({"json_schema": {"properties": {"a": {"type": "integer"}}, "type": "object"}})
    assert a == ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert a.key == b.key  # one cache entry, whatever the key order or spacing
    assert to_constraint({"choice": ("a", "b")}).value == ["a", "b"]
    assert to_constraint(None) is None
    assert RequestSpec("x", constraint={"regex": "a+"}).constraint == ConstraintSpec("regex", "a+")


@pytest.mark.parametrize("value, words", [
    ("a+", "must be a mapping of one kind"),
    ({}, "exactly one kind (got 0"),
    ({"regex": "a", "choice": ["a"]}, "exactly one kind (got 2: regex, choice)"),
    ({"json_schema": "{not json"}, "constraint.json_schema: is not valid JSON"),
    ({"regex": float("nan")}, "plain JSON data"),
    ({"choice": [object()]}, "plain JSON data"),
])
def test_bad_shapes_name_the_problem(value, words):
    with pytest.raises(InvalidRequestError) as err:
        RequestSpec("x", constraint=value)
    assert words in str(err.value)
