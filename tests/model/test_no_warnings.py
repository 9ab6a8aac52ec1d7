"""Importing the package and the model core prints no warnings (torch warns "Failed to initialize NumPy" when
numpy is missing: numpy is a declared dependency)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMPORTS = (
    "import litellm_pipeline, torch; "
    "from litellm_pipeline.model import attention, attention_cpu, config, decoder, layer_ops, layers, loader, moe"
)


def test_model_core_imports_without_warnings():
    proc = subprocess.run([sys.executable, "-W", "default", "-c", IMPORTS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


def test_numpy_is_a_declared_dependency():
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert deps is not None
    names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', deps.group(1), re.M)
    assert "numpy" in names
