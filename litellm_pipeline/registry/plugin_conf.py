"""Config groups that installed plugins ship: the ``litellm-plugins://`` Hydra config source.

A plugin declares the package holding its config options with an entry point in group
``litellm_pipeline.conf`` (the value is a package name; ``pkg://package.name`` is accepted too)::

    [project.entry-points."litellm_pipeline.conf"]
    my_plugin = "my_plugin.conf"

That package's folder (it needs an ``__init__.py``, and its YAML files must be shipped as package data) is laid
out like ``conf/``: every ``<group>/<option>.yaml`` becomes an option of ``<group>``, selected from the command
line like a built-in one: ``budget=my_option`` adds an option to an existing group, ``+my_group=x`` selects one of
a group only the plugin has. An option named like a built-in option of the same group is shadowed by the
built-in (the package's own ``conf/`` comes first on the search path), so a plugin cannot change what an
existing command line means.

Why one config source serving every plugin rather than a ``pkg://`` entry per plugin on ``hydra.searchpath``:
the search path is a list in ``conf/config.yaml`` that cannot grow with what is installed, and a Hydra
``SearchPathPlugin`` would have to live in a ``hydra_plugins`` namespace package of its own (see
:mod:`litellm_pipeline.config.compose` for the same reasoning about recipes). ``conf/config.yaml`` lists
``litellm-plugins://`` once; the source finds the entry points each time a config is composed.

The plugin filter applies here through its environment variables only (``LITELLM_PIPELINE_PLUGINS_ALLOW`` /
``_DENY``): ``plugins.allow`` / ``plugins.deny`` are themselves part of the config being composed.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata, resources
from typing import Any, List, Mapping, Optional

from hydra._internal.core_plugins.importlib_resources_config_source import (
    ImportlibResourcesConfigSource,
)
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource

from litellm_pipeline.registry.filter import PluginFilter

CONF_GROUP = "litellm_pipeline.conf"
PLUGIN_CONF_SCHEME = "litellm-plugins"


@dataclass(frozen=True)
class ConfRoot:
    """One plugin's config package, as its ``litellm_pipeline.conf`` entry point declares it."""

    name: str  # the entry point's name
    package: str  # dotted package whose folder holds <group>/<option>.yaml
    dist: str | None
    version: str | None

    @property
    def plugin(self) -> str:
        return f"conf:{self.name}"


def _package(value: str) -> str:
    value = value.strip()
    if value.startswith("pkg://"):
        value = value[len("pkg://"):]
    return value.replace("/", ".").strip(".")


def conf_roots(environ: Mapping[str, str] | None = None) -> tuple[list[ConfRoot], dict[str, str]]:
    """The declared config packages the environment's plugin filter allows, and ``{plugin: why}`` for the rest."""
    flt = PluginFilter.from_settings(environ=environ)
    roots, skipped = [], {}
    try:
        eps = list(metadata.entry_points(group=CONF_GROUP))
    except Exception:  # pragma: no cover - broken metadata on the path
        eps = []
    for ep in eps:
        dist = getattr(ep, "dist", None)
        root = ConfRoot(ep.name, _package(ep.value), dist.metadata["Name"] if dist else None,
                        dist.version if dist else None)
        why = flt.refusal(ep.name, root.plugin, root.dist)
        if why is None:
            roots.append(root)
        else:
            skipped[root.plugin] = why
    return roots, skipped


def _source(root: ConfRoot) -> ImportlibResourcesConfigSource:
    """Hydra's own ``pkg://`` source over one plugin's package (it reads from wheels and zips alike)."""
    return ImportlibResourcesConfigSource(f"plugin {root.name} ({root.dist or '?'})", f"pkg://{root.package}")


def root_error(root: ConfRoot) -> str | None:
    """Why a declared config package cannot serve options (None: it can)."""
    if not _source(root).available():
        return f"config package {root.package!r} cannot be imported or has no __init__.py"
    return None


def root_options(root: ConfRoot) -> list[tuple[str, str]]:
    """``(group, option)`` for every ``<group>/<option>.yaml`` under the package (nested groups included)."""
    out: list[tuple[str, str]] = []

    def walk(node: Any, group: str) -> None:
        for child in node.iterdir():
            if child.is_dir() and not child.name.startswith(("_", ".")):
                walk(child, f"{group}/{child.name}" if group else child.name)
            elif group and child.name.endswith(".yaml"):
                out.append((group, child.name[: -len(".yaml")]))

    walk(resources.files(root.package), "")
    return sorted(out)


class PluginConfigSource(ConfigSource):
    """Hydra config source over every allowed plugin's config package (``litellm-plugins://``).

    A group exists when any plugin has it; its options are the union; an option loads from the first plugin
    (in entry point order) that has it.
    """

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self._sources: Optional[List[ImportlibResourcesConfigSource]] = None

    @staticmethod
    def scheme() -> str:
        return PLUGIN_CONF_SCHEME

    @property
    def sources(self) -> List[ImportlibResourcesConfigSource]:
        # resolved on first use: Hydra builds a source per composition, so installing a plugin needs no restart
        # of anything but the process that composes
        if self._sources is None:
            roots, _ = conf_roots()
            self._sources = [s for s in map(_source, roots) if s.available()]
        return self._sources

    def load_config(self, config_path: str) -> ConfigResult:
        for src in self.sources:
            if src.is_config(config_path):
                return src.load_config(config_path)
        raise ConfigLoadError(f"Config not found : {self.full_path()}/{config_path}")

    def available(self) -> bool:
        return True  # no plugin installed is a valid state, not a broken search path

    def is_group(self, config_path: str) -> bool:
        return config_path == "" or any(s.is_group(config_path) for s in self.sources)

    def is_config(self, config_path: str) -> bool:
        return any(s.is_config(config_path) for s in self.sources)

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        found: set[str] = set()
        for src in self.sources:
            if src.is_group(config_path):
                found.update(src.list(config_path, results_filter))
        return sorted(found)
