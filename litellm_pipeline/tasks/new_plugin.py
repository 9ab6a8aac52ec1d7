"""``+recipe=new_plugin``: write a ready plugin package for one registry kind.

``python -m litellm_pipeline +recipe=new_plugin plugin.name=NAME plugin.kind=KIND [plugin.dir=.]`` creates
``DIR/NAME/`` holding a pyproject (a lazy entry point ``litellm_pipeline.<kind>: NAME``), the package
``litellm_pipeline_NAME`` whose implementation starts as the kind's reference built-in (subclassed or delegated to,
every method carrying its interface's docstring from :mod:`litellm_pipeline.registry.interfaces`), a test using the
conformance kit (:mod:`litellm_pipeline.testing`) by registry name, and a README. The package installs and passes
its tests unchanged; the author then edits the implementation module.
"""

from __future__ import annotations

import inspect
import keyword
import textwrap
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from litellm_pipeline.errors import ConfigError, section_settings


@dataclass(frozen=True)
class KindSpec:
    """How a kind's skeleton starts: the reference it builds on, and how it is selected and checked."""

    reference: str  # registry name of the built-in it starts from
    ref_import: str  # "module:Attr" of that built-in
    select: str  # the override that selects NAME
    check: str  # the kit's check function
    method_bodies: tuple[tuple[str, str], ...] = ()  # method -> body replacing the delegation to the reference
    check_args: str = ""  # further arguments of the generated test's check call


KINDS: dict[str, KindSpec] = {
    "stage": KindSpec("Stage base, as a pass-through logits stage", "litellm_pipeline.stages.base:Stage",
                      "'+pipeline.stages.$name={impl: $name}' "
                      "'pipeline.order=[admit,select_tier,route,prefill,decode,$name,sample,emit]'",
                      "check_stage", (("__call__", "ctx.logits = ctx.logits  # pass-through: transform ctx.logits here"),)),
    "kv_policy": KindSpec("lru", "litellm_pipeline.engine.kv_policy:LRUPolicy", "cache.kv_policy=$name",
                          "check_kv_policy"),
    "budget_solver": KindSpec("greedy", "litellm_pipeline.budget.solvers:GreedySolver", "budget.solver=$name",
                              "check_budget_solver"),
    "sampler": KindSpec("default", "litellm_pipeline.sampling.samplers:Sampler",
                        "pipeline.stages.sample.params.sampler=$name", "check_sampler"),
    "telemetry": KindSpec("memory", "litellm_pipeline.telemetry.bus:MemorySink", "'telemetry.sinks=[$name]'",
                          "check_telemetry_sink"),
    "scheduler": KindSpec("fcfs", "litellm_pipeline.engine.scheduler:FcfsScheduler", "engine.scheduler=$name",
                          "check_scheduler"),
    "layer_ops": KindSpec("torch", "litellm_pipeline.model.layer_ops:TorchLayerOps",
                          "pipeline.stages.decode.params.layer_ops=$name", "check_layer_ops"),
    "attention": KindSpec("sdpa", "litellm_pipeline.model.attention:sdpa_paged_attention",
                          "pipeline.stages.decode.params.attention=$name", "check_attention"),
    "moe_dispatch": KindSpec("packed", "litellm_pipeline.model.moe:packed_dispatch",
                             "pipeline.stages.decode.params.moe_dispatch=$name", "check_moe_dispatch"),
    "constraint": KindSpec("regex", "litellm_pipeline.constraints.kinds:Regex",
                           "per request: constraint={'$name': VALUE} (server: structured_outputs={'$name': VALUE})",
                           "check_constraint", check_args=', values=["[0-9]{1,3}", "(yes|no)!"], bad_values=["(a"]'),
    "proposer": KindSpec("ngram", "litellm_pipeline.speculative.ngram:NgramProposer", "speculative.method=$name",
                         "check_proposer"),
    "router": KindSpec("tierset", "litellm_pipeline.tiers.router:TierSetRouter",
                       "pipeline.stages.route.params.router=$name", "check_router"),
}


class PluginSettings(BaseModel):
    """The ``plugin:`` section of ``recipes/new_plugin.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: str
    dir: str = "."

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.isidentifier() or keyword.iskeyword(v):
            raise ValueError("must be a Python identifier (letters, digits and _, not starting with a digit; "
                             "not a keyword): it names the registry entry and the package litellm_pipeline_NAME")
        return v

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in KINDS:
            raise ValueError(f"unknown kind; known kinds: {', '.join(KINDS)}")
        return v


def plugin_settings(section: Any) -> PluginSettings:
    return section_settings(PluginSettings, section, "plugin")


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_") if p) or "Plugin"


def _doc(text: str, indent: str) -> str:
    text = text.replace("\\", "\\\\").replace('"""', "'''")
    return textwrap.indent(f'"""{text}"""' if "\n" not in text else f'"""{text}\n"""', indent)


def _plain_signature(fn: Any, skip_self: bool) -> tuple[str, str]:
    """``(a, b, c=None)`` without annotations, and the call passing the same names on."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    shown = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    names = [p.name for p in params[1 if skip_self else 0:]]
    return shown, ", ".join(names)


def _methods(kind: str) -> dict[str, Any]:
    from litellm_pipeline.registry.conformance import members
    from litellm_pipeline.registry.interfaces import INTERFACES

    return dict(members(INTERFACES[kind].protocol).methods)


def implementation(name: str, kind: str) -> tuple[str, str]:
    """The implementation module's text and the attribute the entry point names."""
    from litellm_pipeline.registry.interfaces import INTERFACES

    spec, iface = KINDS[kind], INTERFACES[kind]
    mod, _, attr = spec.ref_import.partition(":")
    bodies = dict(spec.method_bodies)
    head = (f'"""{name}: a litellm_pipeline {kind} ({iface.qualname}).\n\n'
            f"It starts from the built-in {spec.reference} ({spec.ref_import}) and passes the conformance kit as is; "
            f"edit the\nmethods below (their docstrings say what the engine calls when, and what must hold). "
            f"Select it with::\n\n    {Template(spec.select).substitute(name=name)}\n\"\"\"\n\n"
            f"from __future__ import annotations\n\n")
    if iface.function:
        call = _methods(kind)["__call__"]
        sig, args = _plain_signature(call, skip_self=True)
        sig = sig.replace("(self, ", "(", 1)
        doc = _doc(f"{inspect.getdoc(iface.protocol)}\n\n{inspect.getdoc(call)}", "    ")
        return (head + f"from {mod} import {attr} as _reference\n\n\n"
                f"def {name}{sig}:\n{doc}\n    return _reference({args})\n"), name
    cls = _camel(name)
    parts = [head, f"from {mod} import {attr} as _Reference\n\n\n", f"class {cls}(_Reference):\n",
             _doc(inspect.getdoc(iface.protocol) or "", "    "), "\n"]
    if kind == "stage":
        parts.append('\n    # "step": once per engine step, over the whole batch ("request": once per submitted request)\n'
                     '    level = "step"\n    # context fields read: here the logits decode produces, before sample\n'
                     '    inputs = ("logits", "sample_requests")\n'
                     "    # context fields written: every call must set each of them\n"
                     '    outputs = ("logits",)\n\n'
                     "    def __init__(self, rt):  # add keyword parameters: pipeline.stages.<name>.params\n"
                     "        super().__init__(rt)\n")
    for meth, fn in _methods(kind).items():
        sig, args = _plain_signature(fn, skip_self=True)
        body = bodies.get(meth, f"return super().{meth}({args})")
        doc = _doc(inspect.getdoc(fn) or "", " " * 8)
        parts.append(f"\n    def {meth}{sig}:\n{doc}\n        {body}\n")
    return "".join(parts), cls


PYPROJECT = Template('''\
[build-system]
requires = ["setuptools>=70.1"]
build-backend = "setuptools.build_meta"

[project]
name = "litellm_pipeline_$name"
version = "0.1.0"
description = "litellm_pipeline plugin: the $kind $name"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["litellm_pipeline"]

[project.optional-dependencies]
test = ["pytest>=8"]

# Lazy per-kind form: group "litellm_pipeline.<kind>", entry point name = registry name. The module is imported
# the first time a config names it: $select
[project.entry-points."litellm_pipeline.$kind"]
$name = "litellm_pipeline_$name.$kind:$attr"

[tool.setuptools]
packages = ["litellm_pipeline_$name"]

[tool.pytest.ini_options]
testpaths = ["tests"]
''')

INIT = Template('''\
"""litellm_pipeline plugin: the $kind ``$name`` (entry point ``litellm_pipeline.$kind: $name``)."""

from litellm_pipeline_$name.$kind import $attr

__all__ = ["$attr"]
''')

TEST_HEAD = Template('''\
"""Conformance of the $kind ``$name``, looked up by its registry name: this goes through the installed entry point."""

import re

from litellm_pipeline import registry


def _norm(dist):
    return re.sub(r"[-_.]+", "-", dist or "").lower()


def test_registered_through_its_entry_point():
    origin = registry.origin("$kind", "$name")
    assert _norm(origin.dist) == _norm("litellm_pipeline_$name"), f"$kind $name comes from {origin}"
    assert registry.get("$kind", "$name") is not None
''')

TEST_CHECK = Template('''

def test_conformance():
    from litellm_pipeline.testing import $check

    $check("$name"$check_args)
''')

README = Template('''\
# litellm_pipeline_$name

A litellm_pipeline plugin: the **$kind** `$name`, registered through the entry point
`litellm_pipeline.$kind: $name` (see `pyproject.toml`). Generated by
`python -m litellm_pipeline +recipe=new_plugin plugin.name=$name plugin.kind=$kind`.

## Use it

    pip install -e .
    python -m litellm_pipeline +recipe=generate $select

## What to edit

- `litellm_pipeline_$name/$kind.py`: the implementation. It starts from the built-in `$reference` (`$ref_import`)
  so it works out of the box; every method carries the interface's docstring
  (`$qualname`): what the engine calls when, with which shapes, and what must hold. The engine builds it as
  `$built_as`.
- `tests/test_conformance.py`: $test_text Add your own tests next to it.
- `pyproject.toml`: the distribution name, version, description and dependencies. Renaming the registry name means
  changing the entry point (`[project.entry-points."litellm_pipeline.$kind"]`) and the name in the test.

## Test it

    pip install -e ".[test]"
    pytest

The tests look `$name` up by its registry name, so they need the package installed (its entry point registered).
`python -m litellm_pipeline +recipe=plugins` lists it with its origin.
''')


def render(name: str, kind: str) -> dict[str, str]:
    """Every file of the package, relative to its folder ``NAME/``."""
    from litellm_pipeline.registry.interfaces import INTERFACES

    spec, iface = KINDS[kind], INTERFACES[kind]
    code, attr = implementation(name, kind)
    select = Template(spec.select).substitute(name=name)
    sub = dict(name=name, kind=kind, attr=attr, select=select, check=spec.check, check_args=spec.check_args,
               reference=spec.reference,
               ref_import=spec.ref_import, qualname=iface.qualname, built_as=iface.built_as)
    test = TEST_HEAD.substitute(sub) + TEST_CHECK.substitute(sub)
    test_text = f"runs the conformance kit's `{spec.check}(\"{name}\")`."
    return {
        "pyproject.toml": PYPROJECT.substitute(sub),
        "README.md": README.substitute(sub, test_text=test_text),
        f"litellm_pipeline_{name}/__init__.py": INIT.substitute(sub),
        f"litellm_pipeline_{name}/{kind}.py": code,
        "tests/test_conformance.py": test,
    }


def new_plugin(name: str, kind: str, directory: str | Path = ".") -> Path:
    """Write the package into ``directory/name``; refuses a bad name or kind and an existing target."""
    s = plugin_settings({"name": name, "kind": kind, "dir": str(directory)})
    from litellm_pipeline import registry

    if s.name in registry.names(s.kind):
        raise ConfigError(f"plugin.name: {s.name!r} is already a {s.kind} name ({registry.origin(s.kind, s.name)}); "
                          "choose another")
    target = Path(s.dir) / s.name
    if target.exists():
        raise ConfigError(f"plugin.dir: {target} already exists; nothing was written (remove it or choose another "
                          "plugin.name / plugin.dir)")
    files = render(s.name, s.kind)
    for rel, text in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target


def run_new_plugin(section: Any) -> Path:
    from hydra.utils import to_absolute_path

    s = plugin_settings(section)
    target = new_plugin(s.name, s.kind, to_absolute_path(s.dir))
    print(f"wrote {target} ({s.kind} {s.name!r}): pip install -e '{target}[test]' && pytest {target}\n"
          f"select it with: {Template(KINDS[s.kind].select).substitute(name=s.name)}")
    return target


def run(cfg) -> Path:
    """Write the plugin the ``plugin`` section names (``plugin.name``, ``plugin.kind`` required). Loads no model."""
    from omegaconf import OmegaConf

    section = cfg.get("plugin")
    if section is not None:
        missing = [k for k in ("name", "kind") if OmegaConf.is_missing(section, k)]
        if missing:
            raise ConfigError("; ".join(f"plugin.{k}: required (plugin.{k}=...)" for k in missing))
        section = OmegaConf.to_container(section, resolve=True)
    return run_new_plugin(section)
