"""Every kernel path this CPU can take is tested, not only its own: the kernel tests run again in a child
process for each smaller build of ``cpu_kernels.ISAS`` this CPU can run (``LITELLM_PIPELINE_CPU_ISA``), so an
AVX-512 BF16 machine also runs the AVX-512, AVX2 and generic code other CPUs run natively. The session's
summary lists which builds ran here and which this CPU could not run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from litellm_pipeline.model import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
# the tests whose outcome depends on the kernel build: the kernels against their references, the one-region
# decode against op by op, batch invariance, and parity with transformers through them
KERNEL_TESTS = (
    "tests/model/test_cpu_kernels.py",
    "tests/model/test_layer_ops.py",
    "tests/model/test_int8_ops.py",
    "tests/model/test_row_linear.py",
    "tests/model/test_attention_cpu.py",
    "tests/model/test_parity.py",
    "tests/engine/test_engine_deterministic.py",
    "tests/sampling/test_samplers.py",
)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(cpu_kernels.ISAS))
def test_kernel_tests_pass_on_every_build_this_cpu_runs(isa):
    if os.environ.get(cpu_kernels.ISA_ENV):
        pytest.skip(f"inside the {os.environ[cpu_kernels.ISA_ENV]} run")
    if isa != "generic" and (missing := cpu_kernels.missing_features(isa)):
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    env = {**os.environ, cpu_kernels.ISA_ENV: isa}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *KERNEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, f"{cpu_kernels.ISA_ENV}={isa}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.splitlines()[-1]
