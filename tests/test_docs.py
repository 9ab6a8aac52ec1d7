"""The front page and the documentation site: README.md stays a front page (at most 15,000 characters) whose
test command is the one CI runs and whose links resolve; the MkDocs site under docs/ builds with --strict (a
broken link or a docstring mkdocstrings cannot read fails it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_a_front_page_with_the_two_commands():
    assert len(README) <= 15_000, f"README.md is {len(README)} characters"
    commands = re.findall(r"```bash\n(python3 -m venv .venv && .*)\n```", README)
    assert len(commands) == 2 and commands[0].endswith("python -m litellm_pipeline +recipe=generate")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[1] == ci  # CI runs exactly the README's test command
    started = (ROOT / "docs" / "getting-started.md").read_text()
    assert re.findall(r"```bash\n(python3 -m venv .venv && .*)\n```", started) == commands  # the docs say the same


def test_readme_links_point_at_files_that_exist():
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", README) if not t.startswith(("http", "#"))]
    assert targets and all((ROOT / t).is_file() for t in targets), [t for t in targets if not (ROOT / t).is_file()]


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    pages = sorted(p.parent.name for p in (tmp_path / "site").rglob("index.html") if p.parent != tmp_path / "site")
    assert len(pages) >= 8 and {"getting-started", "serving", "api", "performance"} <= set(pages)
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "RequestSpec" in api and "SamplingParams" in api  # the reference came from the docstrings
