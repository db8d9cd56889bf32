"""Hydra plugin: the package's config groups on every Hydra app's search path.

With the package installed, a user's own ``@hydra.main`` config picks ``data: megascale`` (and
``strategy``, ``ray``, ``sources``) with no ``hydra.searchpath`` of its own. That key also works,
but Hydra then checks every search-path source and warns for each one it cannot reach; with
megatron-energon installed, multi-storage-client's plugin adds one (``msc://``) that is
unreachable without an MSC profile, so every run would print its traceback and a UserWarning.

Appended last: the app's own directories and groups win. ``MEGASCALE_CONF_DIR`` points it
elsewhere, as it does `megascale_data_ext.config.conf_dir`. Imports nothing but Hydra: Hydra
imports every plugin of the environment at start-up.
"""

from __future__ import annotations

import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "megascale_data_ext"


class MegascaleDataSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://megascale_data_ext/conf`` (or ``file://$MEGASCALE_CONF_DIR``)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        env = os.environ.get("MEGASCALE_CONF_DIR")
        path = f"file://{os.path.abspath(env)}" if env else "pkg://megascale_data_ext/conf"
        if not any(e.path == path for e in search_path.get_path()):
            # named after the variable when it chose the path: Hydra lists providers when a config is missing
            search_path.append(provider="MEGASCALE_CONF_DIR" if env else PROVIDER, path=path)
