"""The config arguments the data commands share (info, lint, heatmap, plan).

A user names a config the way the examples take it: a YAML file and/or Hydra overrides
(``sources=demo_text data.data_root=demo_data``), with ``--config-dir/--config-name`` for
their own Hydra config directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="*", metavar="CONFIG.yaml|OVERRIDE",
                        help="a config YAML file and/or Hydra overrides (key=value, group=option), e.g. "
                             "sources=demo_text data.data_root=demo_data")
    parser.add_argument("--config-dir", default=None, metavar="DIR",
                        help="Hydra config directory (default: the package's conf/)")
    parser.add_argument("--config-name", default=None, metavar="NAME", help="config to compose (default: train_gpt)")


def compose_from_args(args: argparse.Namespace) -> Any:
    """The composed (not yet validated) config the arguments name."""
    from omegaconf import OmegaConf

    from megascale_data_ext.config import compose_config, conf_dir
    from megascale_data_ext.errors import ConfigError

    items = list(args.config)
    if items and "=" not in items[0] and items[0].endswith((".yaml", ".yml")):
        path = Path(items.pop(0))
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        raw = OmegaConf.load(path)
        if "defaults" in raw:
            return compose_config(items, path.stem, config_dir=path.parent, search_path=[conf_dir()])
        bad = [o for o in items if "=" not in o or o.startswith(("+", "~"))]
        if bad:
            raise ConfigError(f"{str(path)!r} has no `defaults`, so only key=value overrides apply; got {bad}")
        return OmegaConf.merge(raw, OmegaConf.from_dotlist(items))
    search = [conf_dir()] if args.config_dir is not None else []  # a user's dir can use the package groups
    return compose_config(items, args.config_name or "train_gpt", config_dir=args.config_dir, search_path=search)


def load_data_config(args: argparse.Namespace, *, check_paths: bool = True, context_parallel_size: int = 1) -> Any:
    """The validated `MegascaleDataConfig` of the arguments (raises ConfigError listing problems)."""
    from megascale_data_ext.config import load_config

    return load_config(compose_from_args(args), check_paths=check_paths, context_parallel_size=context_parallel_size)


def fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2
