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
    "tests/model/test_int4_ops.py",
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


BUILD_ONE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from litellm_pipeline.model import cpu_kernels
cpu_kernels.ops()
print(cpu_kernels.loaded() is not None)
"""


@pytest.mark.slow
def test_two_processes_starting_at_once_build_once_and_both_start(tmp_path):
    """A fresh cache and two processes at once: both load the kernels, each object is compiled once (torch's loader
    holds a file lock in the build folder while one process compiles), and the first build is announced."""
    if os.environ.get(cpu_kernels.ISA_ENV):
        pytest.skip(f"inside the {os.environ[cpu_kernels.ISA_ENV]} run")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), cpu_kernels.ISA_ENV: "generic"}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ONE], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "True", err[-2000:]
    logs = "".join(err for _, err in outs)
    assert "compiling the CPU kernels for this machine (generic build; first run only" in logs
    assert "CPU kernels ready in" in logs
    (build_dir,) = (tmp_path / "litellm_pipeline" / "torch_extensions").iterdir()
    # ninja's log: one line per object built (a second build of the same object would add another)
    built = [ln.split("\t")[3] for ln in (build_dir / ".ninja_log").read_text().splitlines()[1:]]
    assert sorted(built) == sorted(set(built)) and any(b.endswith(".o") for b in built), built


def test_the_build_key_names_torch_python_and_compiler(monkeypatch):
    key = cpu_kernels._source_key()
    monkeypatch.setattr(cpu_kernels.torch, "__version__", "0.0.0-other")
    other_torch = cpu_kernels._source_key()
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "_compiler_id", lambda: "g++ (some other) 1.0")
    other_compiler = cpu_kernels._source_key()
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels.sysconfig, "get_config_var", lambda name: "cpython-399-other")
    other_abi = cpu_kernels._source_key()
    assert len({key, other_torch, other_compiler, other_abi}) == 4
