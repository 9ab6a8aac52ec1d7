"""Fake installed distributions for plugin tests: a ``NAME-VERSION.dist-info`` folder (``METADATA`` and
``entry_points.txt``) next to the modules it names, in a folder put on ``sys.path``. ``importlib.metadata``
discovers it like a pip-installed package, without installing anything into the venv. Also the smallest classes
that satisfy their kinds' interfaces, for tests and for the fake plugins' modules (``from fake_dists import ...``:
``tests/`` is on ``sys.path``)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path


def write_dist(root: Path, name: str, version: str, entry_points: str, files: dict[str, str]) -> Path:
    """Write the distribution ``name`` ``version`` under ``root``; ``files`` maps paths (``mod.py``,
    ``pkg/conf/budget/x.yaml``) to their text, dedented. Returns ``root``."""
    # the folder name spells the name with underscores (as wheels do): importlib.metadata splits it at the first
    # "-" and keeps one distribution per name, so "a-b-1.0" and "a-c-1.0" would both read as a distribution "a"
    dist = root / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


# the smallest classes that satisfy their kinds' interfaces (litellm_pipeline.registry.interfaces)
class TinyPolicy:
    def add(self, block): pass
    def remove(self, block): pass
    def hit(self, block): pass
    def forget(self, block): pass
    def pop(self): return None
    def __len__(self): return 0
    def __contains__(self, block): return False


class TinySolver:
    def solve(self, problem): return None


class TinyStepStage:
    """A step stage that passes the samples through."""

    level = "step"
    inputs = ("samples",)
    outputs = ("samples",)

    def __init__(self, rt):
        pass

    def __call__(self, ctx):
        pass
