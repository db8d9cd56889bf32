"""Hydra wiring: where the YAML group lives, composing it, and the schema in the ConfigStore.

The YAML ships inside the package as ``megascale_data_ext/conf`` (in the repository a link to the
top-level ``conf/``, in a wheel real files), so an editable and a wheel install find it alike;
``MEGASCALE_CONF_DIR`` (or ``config_dir``) points elsewhere. Own ``@hydra.main`` apps find the
groups through the package's Hydra plugin (``hydra_plugins/megascale_data_ext_searchpath``).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megascale_data_ext.config.problems import did_you_mean
from megascale_data_ext.config.schema import MegascaleDataConfig, source_name
from megascale_data_ext.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONF_DIR_ENV = "MEGASCALE_CONF_DIR"


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as group ``data``, name ``megascale_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="data", name="megascale_schema", node=MegascaleDataConfig)


def conf_dir() -> Path:
    """The YAML config directory: ``$MEGASCALE_CONF_DIR``, else the package's own ``conf/``."""
    env = os.environ.get(CONF_DIR_ENV)
    d = Path(env) if env else Path(__file__).resolve().parents[1] / "conf"
    if not (d / "data" / "megascale.yaml").is_file():
        where = f"${CONF_DIR_ENV}={env!r}" if env else "the installed package"
        raise ConfigError(f"no Hydra config group at {str(d)!r} (from {where}; expected data/megascale.yaml): "
                          f"point {CONF_DIR_ENV} at a directory holding data/megascale.yaml (the repository's "
                          "conf/), or unset it and reinstall the package (`pip install -e .` or its wheel)")
    return d


@contextmanager
def hydra_scope(
    config_dir: str | os.PathLike[str] | None = None,
    search_path: Sequence[str | os.PathLike[str]] = (),
    *,
    job_name: str = "megascale_data",
) -> Iterator[None]:
    """Initialise Hydra on ``config_dir`` (default :func:`conf_dir`), then ``search_path``.

    ``config_dir`` is the primary config directory (searched first, like ``initialize_config_dir``);
    each ``search_path`` directory follows in order, before the ConfigStore's structured configs,
    so a user's own directory can pick ``data: megascale`` or ``strategy: llm_balance`` from the
    package's ``conf/`` (given here) while its own files win. Runs in its own GlobalHydra scope,
    restored afterwards, so it also works inside a running Hydra app or a test.

    Raises:
        ConfigError: a directory does not exist.
    """
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    dirs = [Path(config_dir).resolve() if config_dir is not None else conf_dir()]
    dirs += [Path(d).resolve() for d in search_path]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise ConfigError(f"config directory {missing[0]!r} does not exist")
    backup = get_gh_backup()
    try:
        version.setbase("1.3")
        csp = create_config_search_path(search_path_dir=str(dirs[0]))
        for d in dirs[1:]:  # each one right before the ConfigStore, i.e. after the previous one
            csp.prepend(provider="megascale", path=f"file://{d}", anchor=SearchPathQuery(provider="schema"))
        Hydra.create_main_hydra2(task_name=job_name, config_search_path=csp)
        yield
    finally:
        restore_gh_from_backup(backup)


#: Free-form nodes: their keys are checked against the strategy's or the schedule's own arguments
#: (`config.checks`), not by Hydra's struct mode, so an override adds one without Hydra's ``+``
#: (``data.strategy.args.broadcast=[tp,cp]``, ``data.mixing.params={base_weights: [...]}``).
OPEN_NODES = ("data.strategy.args", "data.mixing.params")


def open_node_override(override: str) -> str:
    """`override` as Hydra's ``++`` (set or add) when it sets a key inside one of `OPEN_NODES`."""
    if override.startswith(("+", "~")):
        return override
    key = override.split("=", 1)[0]
    return "++" + override if any(key == n or key.startswith(n + ".") for n in OPEN_NODES) else override


def compose_config(
    overrides: Sequence[str] = (),
    config_name: str = "train_gpt",
    *,
    config_dir: str | os.PathLike[str] | None = None,
    search_path: Sequence[str | os.PathLike[str]] = (),
    return_hydra_config: bool = False,
) -> DictConfig:
    """Compose ``config_name`` from the conf directory with command-line style overrides.

    Uses Hydra's compose API in its own GlobalHydra scope (restored afterwards), so it also
    works inside a running Hydra app or a test. ``search_path``: more config directories
    searched after ``config_dir`` (see :func:`hydra_scope`), e.g. ``[conf_dir()]`` for a user's
    own directory whose configs use the package's groups. ``return_hydra_config`` keeps the
    ``hydra`` node.

    A source may be addressed by name, ``data.sources.web.truncate=true`` (the spelling of the
    hints in error messages): see :func:`source_override_by_index`.

    Raises:
        ConfigError: Hydra cannot compose (unknown group option, bad override syntax, a key
            that is not in the config); Hydra's message lists the available options.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [open_node_override(o) for o in overrides]
    named = [i for i, o in enumerate(overrides) if named_source_override(o) is not None]
    if named:  # compose without them to learn the sources' order, then address each by index
        rest = [o for i, o in enumerate(overrides) if i not in named]
        data = compose_config(rest, config_name, config_dir=config_dir, search_path=search_path).get("data") or {}
        overrides = [source_override_by_index(o, _source_list(data, named_source_override(o)["list"])) if i in named
                     else o for i, o in enumerate(overrides)]
    d = Path(config_dir).resolve() if config_dir is not None else conf_dir()
    where = ", ".join(repr(str(p)) for p in (d, *search_path))
    try:
        if not search_path:
            with initialize_config_dir(config_dir=str(d), version_base="1.3", job_name="megascale_data"):
                return compose(config_name=config_name, overrides=list(overrides),
                               return_hydra_config=return_hydra_config)
        with hydra_scope(d, search_path):
            return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    except MissingConfigException as e:
        raise ConfigError(_missing_config_message(e, config_name, where, overrides, (d, *search_path))) from e
    except (HydraException, OmegaConfBaseException) as e:
        unknown = re.match(r"Could not override '([^']+)'", str(e))
        if unknown:
            raise ConfigError(_unknown_key_message(unknown.group(1), overrides, config_name, config_dir,
                                                   search_path)) from e
        lines = str(e).split("Config search path:")[0].splitlines()  # one line, without Hydra's search path
        detail = " ".join(line.strip() for line in lines if line.strip())
        raise ConfigError(f"cannot compose {config_name!r} from {where} with overrides {list(overrides)}: "
                          f"{detail}") from e


def _unknown_key_message(key: str, overrides: Sequence[str], config_name: str, config_dir: str | Path | None,
                         search_path: Sequence[str | Path]) -> str:
    """One line for an override of a key the config does not have: the keys beside it, the closest first."""
    given = next((o for o in overrides if o.split("=", 1)[0] == key), key)
    parent, _, leaf = key.rpartition(".")
    try:
        from omegaconf import DictConfig, OmegaConf

        rest = [o for o in overrides if o.split("=", 1)[0] != key]
        cfg = compose_config(rest, config_name, config_dir=config_dir, search_path=search_path)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        while node is None and parent:  # `nope.x`: the keys of the nearest node that exists
            parent, _, leaf = parent.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
    except ConfigError:
        keys = []
    where = f"under `{parent}`" if parent else "at the top"
    have = f"; the keys {where} are {', '.join(keys)}" if keys else ""
    close = difflib.get_close_matches(leaf, keys, n=1)
    if close and "=" in given:  # the whole override with the misspelled part respelled: pasteable
        parts, at = key.split("."), len(parent.split(".")) if parent else 0
        fix = f"did you mean `{'.'.join([*parts[:at], close[0], *parts[at + 1:]])}={given.split('=', 1)[1]}`? "
    else:
        fix = did_you_mean(leaf, keys)
    return f"{given}: the config has no key `{key}`; {fix}check its spelling{have}"


def _missing_config_message(e: Any, config_name: str, where: str, overrides: Sequence[str],
                            dirs: Sequence[str | Path] = ()) -> str:
    """One line for Hydra's missing config: the override that named it, the group's options, one to paste."""
    group, _, option = str(e.missing_cfg_file or "").rpartition("/")
    options = list(e.options or [])
    if not group:
        names = sorted({f.stem for d in dirs for f in Path(d).glob("*.yaml") if not f.stem.startswith("_")})
        close = difflib.get_close_matches(config_name, names, n=1)
        have = (f"; the configs there are {', '.join(names)}" + (f" (did you mean --config-name {close[0]}?)"
                                                                  if close else "")) if names else ""
        return f"config {config_name!r} not found in {where}{have}; check --config-name and --config-dir"
    given = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0].split("@", 1)[0] == group),
                 f"{group}={option}")
    if not options:
        return f"{given}: config group {group!r} not found in {where}"
    close = difflib.get_close_matches(option, options, n=1)
    return (f"{given}: config group {group!r} has no option {option!r}; pick one of {', '.join(options)} "
            f"(e.g. {group}={close[0] if close else options[0]})")


# ``data.sources.<name>.<key>=<value>`` (any ``+`` prefix; also ``data.validation.sources``): a
# source addressed by its name, the spelling every hint uses; Hydra addresses list items only by index.
_BY_NAME = re.compile(r"^\+{0,2}data\.(?P<list>(?:validation\.)?sources)\.(?P<name>[^.=\[\]]+)\.(?P<rest>[^=]+)"
                      r"=(?P<value>.*)$", re.S)


def _source_list(data: Any, key: str) -> Sequence:
    """The composed ``data`` node's list at ``key`` (``sources`` or ``validation.sources``)."""
    node = data
    for part in key.split("."):
        node = (node or {}).get(part)
    return node or []


def named_source_override(override: str) -> re.Match[str] | None:
    """``data.sources.<name>.<key>=<value>`` split into ``list``, ``name``, ``rest``, ``value`` (None: not one)."""
    m = _BY_NAME.match(override)
    return None if m is None or m["name"].isdigit() else m


def source_override_by_index(override: str, sources: Sequence) -> str:
    """``data.sources.web.truncate=true`` as Hydra takes it: ``++data.sources.<i>.truncate=true``
    (set or add), ``i`` the position of the source named ``web`` (its ``name``, else the name
    derived from its first path, as the schema names it).

    Raises:
        ConfigError: No source has that name.
    """
    from types import SimpleNamespace

    m = named_source_override(override)
    if m is None:
        return override
    names = []
    for i, s in enumerate(sources):
        fields = {k: s.get(k) for k in ("name", "path")} | {"paths": list(s.get("paths") or [])}
        names.append(source_name(SimpleNamespace(**fields), i))
    if m["name"] not in names:
        raise ConfigError(f"override {override!r}: no source named {m['name']!r} in data.{m['list']}; "
                          f"{did_you_mean(m['name'], names)}sources: {names}")
    return f"++data.{m['list']}.{names.index(m['name'])}.{m['rest']}={m['value']}"
