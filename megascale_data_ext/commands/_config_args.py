"""The config and layout arguments the data commands share (info, lint, heatmap, plan, serve).

A user names a config the way the examples take it: a YAML file and/or Hydra overrides
(``sources=demo_text data.data_root=demo_data``), with ``--config-dir/--config-name`` for
their own Hydra config directory. A trainer layout is spelled one way in every command:
``--world-size N [--tp --pp --cp --vpp]``, each size defaulting to the config's ``parallel``
node (what the trainer will run), DP derived as Megatron derives it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

LAYOUT_FLAGS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                "cp": "context_parallel_size", "vpp": "virtual_pipeline_model_parallel_size"}


def positive_int(text: str) -> int:
    """An argparse type for sizes and counts: argparse's one-line error (exit 2) for 0, negatives and non-integers."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="*", metavar="CONFIG.yaml|OVERRIDE|DATASET",
                        help="a config YAML file and/or Hydra overrides (key=value, group=option), e.g. "
                             "sources=demo_text data.data_root=demo_data; or dataset paths (a Parquet or JSONL "
                             "file or directory, a Megatron .bin/.idx prefix), one source each")
    parser.add_argument("--config-dir", default=None, metavar="DIR",
                        help="Hydra config directory (default: the package's conf/)")
    parser.add_argument("--config-name", default=None, metavar="NAME", help="config to compose (default: train_gpt)")


_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".tar": "webdataset", ".bin": "megatron", ".idx": "megatron"}


def dataset_source(item: str) -> dict[str, Any] | None:
    """A source entry for a dataset path on the command line (None: not one).

    A ``.parquet`` / ``.jsonl`` / WebDataset ``.tar`` file or a directory holding them, or a Megatron prefix (its
    ``.bin``/``.idx`` or the prefix itself): one source named after the path.
    """
    if "=" in item or item.endswith((".yaml", ".yml")):
        return None
    path = Path(item)
    if path.suffix in (".bin", ".idx"):
        path = path.with_suffix("")
    if Path(f"{path}.idx").is_file():
        return {"name": path.name, "format": "megatron", "paths": [str(path)]}
    if path.is_file() and path.suffix in _FORMATS:
        return {"name": path.stem, "format": _FORMATS[path.suffix], "paths": [str(path)]}
    if path.is_dir():
        kinds = sorted({_FORMATS[p.suffix] for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".tar")})
        if len(kinds) == 1:
            return {"name": path.name, "format": kinds[0], "paths": [str(path)]}
        if not kinds and any(path.rglob("*.idx")):
            prefixes = sorted(str(p.with_suffix("")) for p in path.rglob("*.idx"))
            return {"name": path.name, "format": "megatron", "paths": prefixes}
    return None


def not_a_dataset(item: str) -> str:
    """Why a command-line item that is not an override is not a dataset either, and what would be."""
    kinds = "a Parquet or JSONL file or directory, WebDataset .tar shards, or a Megatron prefix with its .bin/.idx"
    path = Path(item)
    if path.is_dir():
        found = sorted({p.suffix for p in path.rglob("*") if p.suffix in _FORMATS})
        what = (f"mixes {', '.join(found)} files: name one format's files or directory" if len(found) > 1
                else "holds no .parquet, .jsonl, .tar or .idx files")
        return f"{item!r} {what} ({kinds})"
    if path.suffix in (".bin", ".idx") or Path(f"{path}.bin").exists():
        prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
        other = Path(f"{prefix}.bin" if path.suffix == ".idx" else f"{prefix}.idx")
        if not other.exists():
            return (f"{item!r} is half of a Megatron prefix: {str(other)!r} does not exist; put the .bin/.idx pair "
                    "side by side (tools/preprocess_data.py writes both)")
    if path.exists():
        return f"{item!r} is not a dataset file: pass {kinds}"
    return f"{item!r} does not exist: check the path ({kinds}); a Hydra override is key=value"


def compose_from_args(args: argparse.Namespace) -> Any:
    """The composed (not yet validated) config the arguments name. Dataset paths among them
    replace the config's sources (one source each, equal weights), so `info` / `lint` run on
    data without a training config."""
    from omegaconf import OmegaConf

    from megascale_data_ext.config import compose_config, conf_dir
    from megascale_data_ext.config.hydra import named_source_override
    from megascale_data_ext.errors import ConfigError

    found = [dataset_source(item) for item in args.config]  # a directory is walked once
    datasets = [d for d in found if d is not None]
    for item, d in zip(args.config, found, strict=True):  # neither key=value, ~key, YAML nor a dataset: say why
        if d is None and "=" not in item and not item.startswith("~") and not item.endswith((".yaml", ".yml")):
            raise ConfigError(not_a_dataset(item))
    if datasets:
        names = [d["name"] for d in datasets]
        for i, d in enumerate(datasets):  # unique names, as the config requires
            if names.count(d["name"]) > 1:
                d["name"] = f"{d['name']}-{i}"
        names = [d["name"] for d in datasets]
        rest = [c for c, d in zip(args.config, found, strict=True) if d is None]
        # data.sources.<name>.<key>=<value> for a dataset named here (what its error hints print) applies to it
        on_datasets = [m for m in map(named_source_override, rest)
                       if m and m["list"] == "sources" and m["name"] in names]
        rest = [c for c in rest if not any(c == m.string for m in on_datasets)]
        cfg = compose_from_args(argparse.Namespace(**{**vars(args), "config": rest}))
        cfg.data.sources = datasets
        for m in on_datasets:
            value = OmegaConf.from_dotlist([f"v={m['value']}"]).v
            OmegaConf.update(cfg, f"data.sources.{names.index(m['name'])}.{m['rest']}", value, force_add=True)
        if "validation" in cfg.data:  # the config's held-out sources are not among the datasets named
            cfg.data.validation.sources = []
        if "data_root" in cfg.data:
            cfg.data.data_root = None
        return cfg
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


def add_layout_arguments(parser: argparse.ArgumentParser, *, default_dp: int | None = None) -> None:
    """``--world-size`` (required unless `default_dp` makes it tp·pp·cp × default_dp) and
    ``--tp/--pp/--cp/--vpp``."""
    parser.add_argument("--world-size", type=int, required=default_dp is None, default=None,
                        help="trainer ranks (dp = world / (tp*pp*cp))"
                             + ("" if default_dp is None else f"; default tp*pp*cp*{default_dp} (DP {default_dp})"))
    parser.set_defaults(default_dp=default_dp)
    for flag, key in LAYOUT_FLAGS.items():
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"default: the config's parallel.{key}, else "
                                                                      f"{'none' if flag == 'vpp' else 1}")


def layout_sizes(cfg: Any, args: argparse.Namespace) -> dict[str, int | None]:
    """tp/pp/cp/vpp: the flags, else the composed config's ``parallel`` node, else 1 (vpp: None)."""
    par = (cfg.get("parallel") if hasattr(cfg, "get") else None) or {}
    return {flag: getattr(args, flag) if getattr(args, flag) is not None
            else par.get(key, None if flag == "vpp" else 1) for flag, key in LAYOUT_FLAGS.items()}


def layout_tree(cfg: Any, args: argparse.Namespace, *, what: str) -> tuple[Any, dict[str, int | None]]:
    """(ClientPlaceTree, sizes) of the layout arguments; ParallelLayoutError names every problem
    (`what` says what cannot be done with it: "serve", "plan", ...)."""
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.errors import ParallelLayoutError
    from megascale_data_ext.megatron.preflight import layout_problems

    sizes = layout_sizes(cfg, args)
    if args.world_size is None:
        args.world_size = int(sizes["tp"]) * int(sizes["pp"]) * int(sizes["cp"]) * args.default_dp
    problems = layout_problems({"parallel": {key: sizes[f] for f, key in LAYOUT_FLAGS.items()}}, args.world_size)
    if args.world_size < 1:
        problems.insert(0, f"--world-size must be >= 1, got {args.world_size}")
    if problems:
        raise ParallelLayoutError(f"cannot {what} this layout: " + "; ".join(problems))
    tree = ClientPlaceTree.from_sizes(tp=sizes["tp"], pp=sizes["pp"], cp=sizes["cp"], vpp=sizes["vpp"],
                                      world_size=args.world_size)
    return tree, sizes
