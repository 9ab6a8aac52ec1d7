"""The conformance kit as a pytest plugin (installed with the package: entry point group ``pytest11``).

* The fixture ``litellm_conformance``: ``litellm_conformance(kind, impl, **kwargs)`` runs the kit's check of that
  kind (``check_kv_policy`` for ``"kv_policy"``, ...) on ``impl`` (a registry name or the object), so a plugin's
  own tests need no import of the kit::

      def test_my_policy(litellm_conformance):
          litellm_conformance("kv_policy", "my_policy")

* ``pytest --litellm-conformance``: one test per entry that installed plugins register, of every kind, running
  its kind's check. ``--litellm-conformance=DIST`` (repeatable) keeps those of that distribution (or plugin
  name). An entry gives its check's keyword arguments in an optional class attribute ``conformance`` (a dict,
  e.g. ``{"values": [...]}`` for a constraint kind, or ``{"params": {...}}`` for a stage); an entry whose check
  needs arguments it does not give is skipped, saying which. No test files are needed::

      pytest --litellm-conformance=my-plugin -p no:cacheprovider

Importing this module imports neither torch nor the engine: pytest loads it in every session of an environment
where the package is installed.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import pytest

CHECKS: dict[str, str] = {
    "stage": "check_stage",
    "attention": "check_attention",
    "moe_dispatch": "check_moe_dispatch",
    "layer_ops": "check_layer_ops",
    "router": "check_router",
    "sampler": "check_sampler",
    "kv_policy": "check_kv_policy",
    "budget_solver": "check_budget_solver",
    "scheduler": "check_scheduler",
    "telemetry": "check_telemetry_sink",
    "constraint": "check_constraint",
    "proposer": "check_proposer",
}


def check_function(kind: str) -> Callable[..., Any]:
    """The kit's check for ``kind``; a ValueError naming the kinds for any other."""
    if kind not in CHECKS:
        raise ValueError(f"no conformance check for kind {kind!r}; kinds: {', '.join(CHECKS)}")
    from litellm_pipeline import testing

    return getattr(testing, CHECKS[kind])


def run_check(kind: str, impl: Any, **kwargs: Any) -> Any:
    """Run the kit's check of ``kind`` on ``impl`` (a registry name or the object); returns what the check does."""
    return check_function(kind)(impl, **kwargs)


def missing_arguments(kind: str, kwargs: dict[str, Any]) -> list[str]:
    """The arguments the check of ``kind`` requires beyond the implementation that ``kwargs`` does not give."""
    params = list(inspect.signature(check_function(kind)).parameters.values())[1:]
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in kwargs]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("litellm_pipeline", "litellm_pipeline conformance kit")
    group.addoption(
        "--litellm-conformance", action="append", nargs="?", const="*", default=None, metavar="DIST",
        help="run the conformance kit on every entry installed plugins register (or those of distribution DIST; "
             "repeatable)",
    )


@pytest.fixture
def litellm_conformance() -> Callable[..., Any]:
    """``litellm_conformance(kind, impl, **kwargs)``: the conformance kit's check of ``kind`` on ``impl``."""
    return run_check


class ConformanceItem(pytest.Item):
    """One registry entry of an installed plugin, checked by its kind's conformance check."""

    def __init__(self, *, kind: str, entry: str, source: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.kind, self.entry, self.source = kind, entry, source

    def runtest(self) -> None:
        from litellm_pipeline import registry

        obj = registry.get(self.kind, self.entry)
        kwargs = getattr(obj, "conformance", None) or {}
        if not isinstance(kwargs, dict):
            raise TypeError(f"{self.kind} {self.entry!r}: its `conformance` attribute must be a dict of the check's "
                            f"keyword arguments (got {type(kwargs).__name__})")
        missing = missing_arguments(self.kind, kwargs)
        if missing:
            pytest.skip(f"{CHECKS[self.kind]} needs {', '.join(missing)}: give them in the entry's `conformance` "
                        f"attribute, or call the check from the plugin's own tests")
        run_check(self.kind, obj, **kwargs)

    def repr_failure(self, excinfo, style=None):  # noqa: ANN001 - pytest's signature
        if isinstance(excinfo.value, AssertionError):
            return f"{self.kind} {self.entry!r} ({self.source}) fails {CHECKS[self.kind]}:\n{excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):  # noqa: ANN201 - pytest's signature
        return self.path, None, f"conformance of {self.kind} {self.entry!r} from {self.source}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    wanted = config.getoption("litellm_conformance", None)
    if not wanted:
        return
    from litellm_pipeline import registry

    registry.load_plugins()
    dists = None if "*" in wanted else {_normalize(w) for w in wanted}
    found, seen = [], set()
    for kind in CHECKS:
        for name in registry.names(kind):
            origin = registry.origin(kind, name)
            if origin.builtin or origin.plugin is None:
                continue  # built-ins have their own tests; run-time registrations are the caller's
            seen.add(origin.dist or origin.plugin)
            keys = {_normalize(k) for k in (origin.dist, origin.plugin, name) if k}
            if dists is not None and not keys & dists:
                continue
            found.append(ConformanceItem.from_parent(
                session, name=f"conformance[{kind}:{name}]", kind=kind, entry=name, source=str(origin)))
    if not found:
        raise pytest.UsageError(
            "--litellm-conformance: no installed plugin entry" + ("" if dists is None else f" of {', '.join(wanted)}")
            + f"; installed plugins: {', '.join(sorted(seen)) or 'none'}")
    items.extend(found)
