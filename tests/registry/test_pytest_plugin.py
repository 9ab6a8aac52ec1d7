"""The conformance kit as a pytest plugin: ``pytest --litellm-conformance[=DIST]`` checks every entry installed
plugins register, and the ``litellm_conformance`` fixture runs a kind's check from a plugin's own tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from fake_dists import write_dist

from litellm_pipeline.testing.pytest_plugin import CHECKS, missing_arguments

LEAKY = """
    class LeakyPolicy:
        \"\"\"Never forgets a block it was given: it evicts blocks that requests use again.\"\"\"

        def __init__(self):
            self.blocks = []

        def add(self, block):
            self.blocks.append(block)

        def remove(self, block):
            pass

        def hit(self, block):
            pass

        def forget(self, block):
            pass

        def pop(self):
            return self.blocks.pop(0) if self.blocks else None

        def __len__(self):
            return len(self.blocks)

        def __contains__(self, block):
            return block in self.blocks
"""


def _pytest(cwd, *args, path=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(path or ""), os.environ.get("PYTHONPATH", ""))
                                                       if p)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-rs", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_every_kind_has_a_check_and_its_required_arguments_are_known():
    from litellm_pipeline import registry, testing

    assert set(CHECKS) == set(registry.KINDS)
    assert all(hasattr(testing, name) for name in CHECKS.values())
    assert missing_arguments("constraint", {}) == ["values"]
    assert missing_arguments("constraint", {"values": []}) == []
    assert missing_arguments("kv_policy", {}) == []


def test_conformance_option_checks_an_installed_plugin(tmp_path):
    got = _pytest(tmp_path, "--litellm-conformance=litellm-pipeline-cost-aware-kv")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "1 passed" in got.stdout


def test_conformance_option_fails_a_broken_entry_naming_it(tmp_path):
    site = tmp_path / "site"
    write_dist(site, "leaky-kv", "0.3", "[litellm_pipeline.kv_policy]\nleaky = leaky_mod:LeakyPolicy\n",
               {"leaky_mod.py": LEAKY})
    work = tmp_path / "work"
    work.mkdir()
    got = _pytest(work, "--litellm-conformance=leaky-kv", path=site)
    assert got.returncode == 1, got.stdout + got.stderr
    assert "kv_policy 'leaky' (leaky-kv 0.3) fails check_kv_policy" in got.stdout
    assert "1 failed" in got.stdout
    got = _pytest(work, "--litellm-conformance=no-such-dist", path=site)
    assert got.returncode != 0 and "no installed plugin entry of no-such-dist" in got.stdout + got.stderr
    assert "leaky-kv" in got.stdout + got.stderr  # the installed ones are named


def test_the_fixture_runs_a_kinds_check(tmp_path):
    site = tmp_path / "site"
    write_dist(site, "leaky-kv", "0.3", "[litellm_pipeline.kv_policy]\nleaky = leaky_mod:LeakyPolicy\n",
               {"leaky_mod.py": LEAKY})
    (tmp_path / "test_mine.py").write_text(textwrap.dedent("""
        def test_lru(litellm_conformance):
            litellm_conformance("kv_policy", "lru")

        def test_leaky(litellm_conformance):
            litellm_conformance("kv_policy", "leaky")
    """))
    got = _pytest(tmp_path, "test_mine.py", path=site)
    assert got.returncode == 1, got.stdout + got.stderr
    assert "1 failed, 1 passed" in got.stdout and "test_leaky" in got.stdout
