"""``+recipe=plugins``: what the registry holds and where it comes from, without loading a model.

Per kind, every registered implementation with its origin (``built-in``, or the distribution and version of the
plugin that registered it) and the first line of its docstring; then the config options plugins ship, the plugins
that failed to load (with their errors) and those ``plugins.allow`` / ``plugins.deny`` kept out. Lazily declared
entries are imported here, so a listing also checks each against its interface.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

from litellm_pipeline import registry
from litellm_pipeline.config.compose import config_dir
from litellm_pipeline.registry.plugin_conf import conf_roots, root_error, root_options


def one_line_doc(obj: Any) -> str:
    """The summary of the object's own docstring (a class does not inherit one here), else of its module's: the
    first sentence of the first paragraph (docstrings here wrap their summary over several lines)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc:
        doc = getattr(sys.modules.get(getattr(obj, "__module__", ""), None), "__doc__", None)
    paragraph = " ".join(line.strip() for line in (doc or "").strip().split("\n\n")[0].splitlines())
    if not paragraph:
        return "(no docstring)"
    end = re.search(r"[.!?](\s|$)", paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def _plugin_label(plugin: str) -> str:
    origin = registry.plugin_origin(plugin)
    return f"{plugin} ({origin})" if origin is not None and origin.dist else plugin


def _row(kind: str, name: str) -> dict:
    try:
        doc = one_line_doc(registry.get(kind, name))
    except registry.RegistryError as exc:  # a built-in whose optional package is missing (triton)
        doc = f"(unavailable: {exc})"
    return {"name": name, "origin": str(registry.origin(kind, name)), "doc": doc}


def collect() -> dict:
    """The listing as plain data: ``kinds`` (kind -> rows), ``config_options``, ``broken``, ``skipped``."""
    registry.load_all()
    kinds = {kind: [_row(kind, name) for name in registry.names(kind)] for kind in registry.KINDS}
    broken = {_plugin_label(p): err for p, err in sorted(registry.broken_plugins().items())}
    skipped = {_plugin_label(p): why for p, why in sorted(registry.skipped_plugins().items())}
    roots, conf_skipped = conf_roots()
    skipped.update(sorted(conf_skipped.items()))
    builtin_conf = config_dir()
    options = []
    for root in roots:
        error = root_error(root)
        if error is not None:
            broken[f"{root.plugin} ({root.dist} {root.version})"] = error
            continue
        for group, option in root_options(root):
            exists = (builtin_conf / group).is_dir()
            options.append({
                "select": f"{'' if exists else '+'}{group}={option}",
                "origin": f"{root.dist} {root.version}" if root.dist else root.plugin,
                "shadowed": (builtin_conf / group / f"{option}.yaml").is_file(),
            })
    return {"kinds": kinds, "config_options": options, "broken": broken, "skipped": skipped}


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def render(listing: dict) -> str:
    out = ["registered implementations (name, origin, doc)"]
    for kind, rows in listing["kinds"].items():
        out.append(f"{kind} ({len(rows)})")
        out += _table([(r["name"], r["origin"], r["doc"]) for r in rows]) if rows else ["  (none)"]
    opts = listing["config_options"]
    out.append(f"config options from plugins ({len(opts)})")
    out += _table([(o["select"], o["origin"], "shadowed by the built-in option of that name" if o["shadowed"] else "")
                   for o in opts]) if opts else ["  (none)"]
    out.append(f"plugins that failed to load ({len(listing['broken'])})")
    out += [f"  {p}: {err}" for p, err in listing["broken"].items()] or ["  (none)"]
    out.append(f"plugins skipped by plugins.allow / plugins.deny ({len(listing['skipped'])})")
    out += [f"  {p}: {why}" for p, why in listing["skipped"].items()] or ["  (none)"]
    return "\n".join(out)


def run_listing(plugins_allow, plugins_deny) -> dict:
    """Apply the config's plugin filter, print the listing, return it as data."""
    registry.set_plugin_filter(plugins_allow, plugins_deny)
    listing = collect()
    print(render(listing))
    return listing


def run(cfg) -> dict:
    """The listing under the config's ``plugins.allow`` / ``plugins.deny``. Loads no model."""
    from litellm_pipeline.tasks import app_config

    section = app_config(cfg).plugins
    return run_listing(section.allow, section.deny)
