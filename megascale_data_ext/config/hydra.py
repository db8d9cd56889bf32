"""Hydra wiring: where the YAML group lives, composing it, and the schema in the ConfigStore.

The YAML lives in ``conf/`` at the repository root, found from this package's location, so an
editable install (``pip install -e .``) needs nothing else; elsewhere set ``MEGASCALE_CONF_DIR``
(or ``config_dir``). Own ``@hydra.main`` apps add :func:`conf_dir` to ``hydra.searchpath``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megascale_data_ext.config.schema import MegascaleDataConfig
from megascale_data_ext.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONF_DIR_ENV = "MEGASCALE_CONF_DIR"


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as group ``data``, name ``megascale_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="data", name="megascale_schema", node=MegascaleDataConfig)


def conf_dir() -> Path:
    """The YAML config directory: ``$MEGASCALE_CONF_DIR``, else ``conf/`` next to the package."""
    env = os.environ.get(CONF_DIR_ENV)
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "conf"
    if not (d / "data" / "megascale.yaml").is_file():
        raise ConfigError(f"no Hydra config group at {str(d)!r} (expected data/megascale.yaml); install the "
                          f"package editable (`pip install -e .`) or set {CONF_DIR_ENV} to the repository's conf/")
    return d


def compose_config(
    overrides: Sequence[str] = (), config_name: str = "train_gpt", *, config_dir: str | os.PathLike[str] | None = None
) -> DictConfig:
    """Compose ``config_name`` from the conf directory with command-line style overrides.

    Uses Hydra's compose API in its own GlobalHydra scope (restored afterwards), so it also
    works inside a running Hydra app or a test.

    Raises:
        ConfigError: Hydra cannot compose (unknown group option, bad override syntax, a key
            that is not in the config); Hydra's message lists the available options.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    d = Path(config_dir).resolve() if config_dir is not None else conf_dir()
    try:
        with initialize_config_dir(config_dir=str(d), version_base="1.3", job_name="megascale_data"):
            return compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        msg = f"cannot compose {config_name!r} from {str(d)!r} with overrides {list(overrides)}: {e}"
        raise ConfigError(msg) from e
