"""``python -m litellm_pipeline +recipe=plugins``: every registered implementation per kind with its origin and
one-line doc, then the plugins that failed to load (with their errors) and those the allow / deny lists skipped;
run as a user runs it, in a subprocess that sees fake installed distributions through PYTHONPATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fake_dists import write_dist

from litellm_pipeline.registry.filter import ENV_ALLOW, ENV_DENY

GOOD_MOD = '''
    from litellm_pipeline import registry


    from fake_dists import TinyStepStage


    class EveryOther(TinyStepStage):
        """Drop every other sampled token (a listing test stage).

        More text that the listing does not show.
        """

        def __call__(self, ctx):
            ctx.samples = ctx.samples[::2]


    class FirstToken:
        """Always token 0."""

        def __init__(self, **params):
            pass

        def __call__(self, logits, rows):
            raise NotImplementedError


    def register():
        registry.add("stage", "fake_every_other", EveryOther)
'''
BROKEN_MOD = """
    raise RuntimeError("no GPU driver here")
"""
GOOD_EPS = """
    [litellm_pipeline.plugins]
    fake_listing_good = fake_listing_good:register

    [litellm_pipeline.sampler]
    fake_first_token = fake_listing_good:FirstToken
"""
BROKEN_EPS = """
    [litellm_pipeline.plugins]
    fake_listing_broken = fake_listing_broken
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    write_dist(root, "fake-listing-good", "1.2.3", GOOD_EPS, {"fake_listing_good.py": GOOD_MOD})
    write_dist(root, "fake-listing-broken", "0.0.1", BROKEN_EPS, {"fake_listing_broken.py": BROKEN_MOD})
    return root


def listing(site, tmp_path, *overrides: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in (ENV_ALLOW, ENV_DENY)}
    # tests/ too: the fake plugin's stage builds on fake_dists.TinyStepStage
    tests = str(Path(__file__).resolve().parents[1])
    environ.update(env, PYTHONPATH=os.pathsep.join(filter(None, [str(site), tests, os.environ.get("PYTHONPATH")])))
    # model.path points nowhere: the listing must not load a model
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=plugins", "model.path=/nonexistent/model", *overrides,
           f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def section(out: str, title: str) -> list[str]:
    """The indented lines under the heading that starts with ``title``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        body.append(line.strip())
    return body


def row(lines: list[str], name: str) -> list[str]:
    """A listing row split into its columns (separated by two or more spaces)."""
    found = [re.split(r"\s{2,}", line) for line in lines if line.split()[0] == name]
    assert len(found) == 1, (name, lines)
    return found[0]


def test_listing_shows_builtins_plugins_and_failures(site, tmp_path):
    out = listing(site, tmp_path)
    # every kind has a section, built-ins with their origin and the summary of their docstring
    for kind in ("stage", "attention", "moe_dispatch", "layer_ops", "router", "sampler", "kv_policy",
                 "budget_solver", "scheduler", "telemetry"):
        assert re.search(rf"^{kind} \(\d+\)$", out, re.M), kind
    assert row(section(out, "kv_policy"), "lru") == [
        "lru", "built-in", "Least recently used: the block freed (or hit) longest ago goes first."]
    assert row(section(out, "attention"), "sdpa")[1] == "built-in"
    # a module's docstring stands in for a class without its own
    assert row(section(out, "stage"), "sample")[2].startswith("sample: next tokens (and logprobs)")
    # entry-point plugins: distribution name and version, and the first sentence of the docstring only
    assert row(section(out, "stage"), "fake_every_other") == [
        "fake_every_other", "fake-listing-good 1.2.3", "Drop every other sampled token (a listing test stage)."]
    assert row(section(out, "sampler"), "fake_first_token") == [
        "fake_first_token", "fake-listing-good 1.2.3", "Always token 0."]
    # the broken plugin is named with its distribution and error, and did not stop the listing
    assert "fake_listing_broken (fake-listing-broken 0.0.1): RuntimeError: no GPU driver here" in \
        section(out, "plugins that failed to load")
    assert section(out, "plugins skipped") == ["(none)"]


def test_environment_deny_skips_a_plugin_by_distribution_name(site, tmp_path):
    out = listing(site, tmp_path, **{ENV_DENY: "fake-listing-good"})
    assert "fake_every_other" not in out and "fake_first_token (fake" in out
    skipped = section(out, "plugins skipped")
    why = f"denied by {ENV_DENY} ('fake-listing-good')"
    assert f"fake_listing_good (fake-listing-good 1.2.3): {why}" in skipped
    assert f"sampler:fake_first_token (fake-listing-good 1.2.3): {why}" in skipped
    assert "lru" in out  # built-ins are never filtered


def test_config_allow_and_deny(site, tmp_path):
    out = listing(site, tmp_path, "plugins.deny=[fake_listing_broken]")
    assert section(out, "plugins that failed to load") == ["(none)"]  # never imported, so it cannot fail
    assert "fake_listing_broken (fake-listing-broken 0.0.1): denied by plugins.deny ('fake_listing_broken')" in \
        section(out, "plugins skipped")
    assert "fake_every_other" in out

    out = listing(site, tmp_path, "plugins.allow=[fake_first_token]", **{ENV_ALLOW: "fake_*"})
    assert "fake_first_token" in " ".join(section(out, "sampler"))
    assert "fake_every_other" not in out
    skipped = section(out, "plugins skipped")
    assert "fake_listing_good (fake-listing-good 1.2.3): not in plugins.allow (fake_first_token)" in skipped
    assert "fake_listing_broken (fake-listing-broken 0.0.1): not in plugins.allow (fake_first_token)" in skipped


def test_one_line_doc():
    from litellm_pipeline.tasks.plugins import one_line_doc

    class Undocumented:
        pass

    class Inherits(Undocumented):
        pass

    def wrapped():
        """First sentence wraps
        over two lines. Second sentence."""

    assert one_line_doc(wrapped) == "First sentence wraps over two lines."
    # a class never inherits a docstring here (Stage subclasses would all show Stage's): its module's stands in
    assert one_line_doc(Inherits).startswith("``python -m litellm_pipeline +recipe=plugins``: every registered")
    assert one_line_doc(Inherits).endswith("through PYTHONPATH.")
