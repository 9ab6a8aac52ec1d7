"""Which third-party plugins may load: ``plugins.allow`` / ``plugins.deny`` and their environment variables.

A *plugin* is one entry point of an installed distribution: in ``litellm_pipeline.plugins`` (named by its entry
point name, e.g. ``example_plugin``), in a per-kind group ``litellm_pipeline.<kind>`` (its registry name, e.g.
``example_argmax``, or ``<kind>:<name>``, e.g. ``sampler:example_argmax``) or in ``litellm_pipeline.conf`` (its
entry point name, or ``conf:<name>``). A pattern matches a plugin when it matches any of those names or the
distribution's name (``litellm_pipeline_example_plugin``), compared after PEP 503 normalisation (case, and ``-``,
``_``, ``.`` alike) and with shell-style wildcards (``*``, ``?``, ``[...]``). Built-ins are never filtered.

Rules: a plugin matched by any deny list does not load; when allow lists are given, a plugin must match every one
of them (config and environment), so the environment can only narrow what a config allows. ``allow: null`` in
config means no restriction, ``allow: []`` allows no plugin; an unset or empty environment variable is no
restriction (use ``LITELLM_PIPELINE_PLUGINS_DENY='*'`` to load none).

Kept free of heavy imports: the Hydra config source of plugin config groups uses it while composing.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

ENV_ALLOW = "LITELLM_PIPELINE_PLUGINS_ALLOW"
ENV_DENY = "LITELLM_PIPELINE_PLUGINS_DENY"


def normalize(name: str) -> str:
    """PEP 503 normalisation, so ``My.Plugin`` and ``my_plugin`` name the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def env_names(value: str | None) -> tuple[str, ...] | None:
    """A comma-separated environment variable as names; None when unset or blank."""
    if value is None or not value.strip():
        return None
    return tuple(n.strip() for n in value.split(",") if n.strip())


def _first_match(patterns: Iterable[str], names: set[str]) -> str | None:
    for pattern in patterns:
        norm = normalize(pattern)
        if any(fnmatch.fnmatchcase(n, norm) for n in names):
            return pattern
    return None


@dataclass(frozen=True)
class PluginFilter:
    """Allow and deny lists, each with where it was set (a config key or an environment variable)."""

    allow: tuple[tuple[str, tuple[str, ...]], ...] = ()
    deny: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def from_settings(
        cls,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> "PluginFilter":
        """The config's lists combined with ``LITELLM_PIPELINE_PLUGINS_ALLOW`` / ``_DENY`` (read now)."""
        env = os.environ if environ is None else environ
        allows, denies = [], []
        if allow is not None:
            allows.append(("plugins.allow", tuple(allow)))
        if deny:
            denies.append(("plugins.deny", tuple(deny)))
        env_allow, env_deny = env_names(env.get(ENV_ALLOW)), env_names(env.get(ENV_DENY))
        if env_allow is not None:
            allows.append((ENV_ALLOW, env_allow))
        if env_deny:
            denies.append((ENV_DENY, env_deny))
        return cls(tuple(allows), tuple(denies))

    def refusal(self, *names: str | None) -> str | None:
        """None when a plugin known by ``names`` may load; else why not (``denied by plugins.deny ('x')``)."""
        keys = {normalize(n) for n in names if n}
        for where, patterns in self.deny:
            hit = _first_match(patterns, keys)
            if hit is not None:
                return f"denied by {where} ({hit!r})"
        for where, patterns in self.allow:
            if _first_match(patterns, keys) is None:
                return f"not in {where} ({', '.join(patterns) or 'empty'})"
        return None
