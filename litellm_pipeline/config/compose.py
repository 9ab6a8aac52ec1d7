"""Where the Hydra config lives and how it is composed, including ``+recipe=NAME``.

A Hydra config group is a folder under a search-path root, but recipes live in the top-level
``recipes/`` folder (not ``conf/recipe/``). :class:`RecipeConfigSource` bridges that: a config
source for the scheme ``litellm-recipes://`` whose only group is ``recipe``, backed by
:func:`recipes_dir`. ``conf/config.yaml`` puts ``litellm-recipes://`` on ``hydra.searchpath``.

Why a source registered in Hydra's ``SourcesRegistry`` rather than a ``SearchPathPlugin`` in a
``hydra_plugins`` namespace package: a plugin package is only found when it is importable as a
top-level ``hydra_plugins`` (installed, or the checkout root on ``sys.path``), it would add our
recipes to every Hydra app in the environment, and it would be one more top-level folder to ship.
Registering from this module works identically from a checkout and from a wheel, because every
entry point that composes the config (:func:`compose`, :func:`hydra_main`) imports this module
first. The cost: code that composes ``conf/`` through Hydra directly must call
:func:`register_recipe_source` first, or Hydra fails loudly with "No config source registered
for schema litellm-recipes". The config groups of installed plugins come the same way, from the
``litellm-plugins://`` source (:mod:`litellm_pipeline.registry.plugin_conf`).
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import hydra
from hydra._internal.sources_registry import SourcesRegistry
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from omegaconf import DictConfig, OmegaConf

from litellm_pipeline.registry.plugin_conf import PluginConfigSource

RECIPE_GROUP = "recipe"
RECIPE_SCHEME = "litellm-recipes"
_VERSION_BASE = "1.3"


def _data_dir(name: str) -> Path:
    """``name`` (``conf`` or ``recipes``) of this copy of the package.

    A wheel maps both folders into the package as ``litellm_pipeline.conf`` /
    ``litellm_pipeline.recipes`` (see pyproject.toml); a checkout keeps them one level above it.
    """
    # The two layouts never coexist for one module file, so the order only matters for a stray
    # top-level `conf/config.yaml` in site-packages: looking inside the package first means such a
    # folder cannot hijack an installed copy. A Traversable that is not a real Path (zip import)
    # cannot be handed to Hydra's file-based loaders, hence the isinstance check.
    packaged = resources.files("litellm_pipeline").joinpath(name)
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    checkout_root = Path(__file__).resolve().parents[2]
    if (checkout_root / "conf" / "config.yaml").is_file():
        return checkout_root / name
    raise FileNotFoundError(
        f"litellm_pipeline: no '{name}' folder in the installed package ({packaged}) "
        f"or the checkout ({checkout_root / name})"
    )


def config_dir() -> Path:
    """The folder holding ``config.yaml`` and one sub-folder per config group."""
    return _data_dir("conf")


def recipes_dir() -> Path:
    """The folder holding ``NAME.yaml`` for every ``+recipe=NAME``."""
    return _data_dir("recipes")


def _recipe_names(root: Path) -> List[str]:
    return sorted(p.stem for p in root.glob("*.yaml") if p.is_file())


def known_recipes() -> List[str]:
    """Names accepted by ``+recipe=NAME``, sorted."""
    return _recipe_names(recipes_dir())


class RecipeConfigSource(ConfigSource):
    """Hydra config source exposing one group, ``recipe``, whose options are ``<dir>/*.yaml``.

    ``litellm-recipes://`` serves :func:`recipes_dir`; ``litellm-recipes:///abs/dir`` serves
    another folder (e.g. a user's own recipes added to ``hydra.searchpath``).
    """

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        # Resolved lazily: the empty path means "this package's recipes", wherever it is installed.
        self._root: Optional[Path] = Path(self.path) if self.path else None

    @staticmethod
    def scheme() -> str:
        return RECIPE_SCHEME

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = recipes_dir()
        return self._root

    def _file(self, config_path: str) -> Optional[Path]:
        """The yaml for ``recipe/NAME``; None for anything outside the single group."""
        group, _, name = self._normalize_file_name(config_path).partition("/")
        if group != RECIPE_GROUP or not name or "/" in name:
            return None
        return self.root / name

    def load_config(self, config_path: str) -> ConfigResult:
        file = self._file(config_path)
        if file is None or not file.is_file():
            raise ConfigLoadError(f"Config not found : {self.full_path()}/{config_path}")
        text = file.read_text(encoding="utf-8")
        return ConfigResult(
            config=OmegaConf.create(text),
            path=self.full_path(),
            provider=self.provider,
            header=ConfigSource._get_header_dict(text[:512]),
        )

    def available(self) -> bool:
        return self.root.is_dir()

    def is_group(self, config_path: str) -> bool:
        return config_path in ("", RECIPE_GROUP)

    def is_config(self, config_path: str) -> bool:
        file = self._file(config_path)
        return file is not None and file.is_file()

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        if config_path == "" and results_filter in (None, ObjectType.GROUP):
            return [RECIPE_GROUP]
        if config_path == RECIPE_GROUP and results_filter in (None, ObjectType.CONFIG):
            return _recipe_names(self.root)
        return []


def register_recipe_source() -> None:
    """Make ``litellm-recipes://`` and ``litellm-plugins://`` (plugins' config groups, see
    :mod:`litellm_pipeline.registry.plugin_conf`) known to Hydra (idempotent).

    Done at import and again before each composition, because Hydra launchers may reset its
    singletons (``Singleton.set_state``) to a state captured before this module was imported.
    """
    SourcesRegistry.instance().register(RecipeConfigSource)
    SourcesRegistry.instance().register(PluginConfigSource)


register_recipe_source()


def _check_no_plain_recipe_key(cfg: DictConfig) -> None:
    # Hydra turns `+recipe=X` into a plain key when no search-path root has a `recipe` group
    # (e.g. `hydra.searchpath=[...]` on the command line replaced ours); a recipe file without
    # `# @package _global_` would likewise land under `recipe:`. Either way the recipe did not apply.
    if RECIPE_GROUP in cfg:
        raise ValueError(
            f"'{RECIPE_GROUP}' ended up as a plain config key ({cfg[RECIPE_GROUP]!r}), so the recipe "
            f"was not applied: keep '{RECIPE_SCHEME}://' in hydra.searchpath and start recipe files "
            f"with '# @package _global_'. Known recipes: {', '.join(known_recipes())}"
        )


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``config_name`` from :func:`config_dir` with Hydra overrides, outside ``@hydra.main``.

    Supports ``+recipe=NAME``; an unknown recipe raises Hydra's error listing the known ones.
    Leaves Hydra's global state as it found it, so it may be called repeatedly, from tests, and
    from inside a running Hydra app.
    """
    register_recipe_source()
    gh = GlobalHydra.instance()
    outer = gh.hydra  # set when called from inside @hydra.main or another initialize()
    gh.clear()
    try:
        with hydra.initialize_config_dir(
            config_dir=str(config_dir()), job_name="litellm_pipeline", version_base=_VERSION_BASE
        ):
            cfg = hydra.compose(config_name=config_name, overrides=list(overrides))
    finally:
        # initialize_config_dir restored a (cleared) copy of the instance; put the outer app back
        if outer is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(outer)
    _check_no_plain_recipe_key(cfg)
    return cfg


def hydra_main(task_fn: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """``@hydra.main`` over :func:`config_dir`'s ``config.yaml`` with ``+recipe=NAME`` support.

    The returned callable parses ``sys.argv`` like any Hydra app (overrides, ``-m`` multirun,
    ``--cfg``, ``--info``) and calls ``task_fn(cfg)`` once per job.
    """
    register_recipe_source()

    @functools.wraps(task_fn)  # Hydra unwraps to task_fn to name the job after its module
    def task(cfg: DictConfig) -> Any:
        _check_no_plain_recipe_key(cfg)
        return task_fn(cfg)

    return hydra.main(config_path=str(config_dir()), config_name="config", version_base=_VERSION_BASE)(task)
