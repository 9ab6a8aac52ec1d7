"""The request error taxonomy a server maps to HTTP status codes."""

from __future__ import annotations

import pytest

from litellm_pipeline.errors import (
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RateLimitedError,
    RequestError,
)


@pytest.mark.parametrize(
    "err, status, also",
    [
        (InvalidRequestError("prompt", "is empty"), 400, ValueError),
        (NotFoundError("no model 'x'"), 404, LookupError),
        (RateLimitedError("over the token quota", retry_after_s=2.5, quota="tokens_per_minute"), 429, RequestError),
        (OverloadedError("queue full"), 503, RequestError),
        (InternalError("step failed"), 500, RuntimeError),
    ],
)
def test_each_error_has_its_status_and_is_a_request_error(err, status, also):
    assert isinstance(err, RequestError) and isinstance(err, also)
    assert err.status_code == status == type(err).status_code


def test_invalid_request_names_the_field_first():
    err = InvalidRequestError("params.max_tokens", "must be >= 1 (got 0)")
    assert str(err) == "params.max_tokens: must be >= 1 (got 0)" and err.field == "params.max_tokens"


def test_rate_limited_carries_retry_after_and_quota():
    err = RateLimitedError("over the request quota", retry_after_s=1.5, quota="requests_per_minute")
    assert (err.retry_after_s, err.quota, str(err)) == (1.5, "requests_per_minute", "over the request quota")


def test_internal_error_has_an_id_in_its_message():
    a, b = InternalError("boom"), InternalError("boom")
    assert a.error_id != b.error_id and len(a.error_id) == 12
    assert str(a) == f"boom (error id {a.error_id})"
    assert InternalError("x", error_id="abc").error_id == "abc"
