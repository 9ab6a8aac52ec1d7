"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from litellm_pipeline.model import cpu_kernels


@pytest.fixture(scope="module")
def ns():
    """The C++ kernels' op namespace (the tests that need it skip where no compiler can build it)."""
    try:
        return cpu_kernels.ops()
    except Exception as exc:  # no compiler here: the kernel tests cannot run
        pytest.skip(f"C++ kernels unavailable: {cpu_kernels.reason(exc)}")
