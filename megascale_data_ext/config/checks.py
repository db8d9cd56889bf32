"""What a well-typed ``data`` config must also satisfy, checked before anything starts.

The runtime's own checks (:meth:`BatchConfig.problems`, :meth:`RayConfig.problems`,
:meth:`SourceSpec.field_problems`, the mix mode) run here on the config values, re-addressed
to config paths; the rest needs the config's view: files on disk, names derived from paths,
``seq_length`` against context parallelism, the mixing schedule and the strategy's arguments.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import os
from collections.abc import Callable
from typing import Any, get_args

from megascale_data_ext.config.coerce import Rules
from megascale_data_ext.config.problems import Problems, did_you_mean
from megascale_data_ext.config.schema import (
    GLOB_CHARS,
    MegascaleDataConfig,
    MixingConfig,
    StrategyConfig,
    locate,
    source_name,
    source_paths,
)
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import MIX_MODES, choice_problems
from megascale_data_ext.sources.base import SourceSpec


def rules() -> Rules:
    """Choices of the config's own str fields (read from their owners, never copied), key hints.

    They are ``str`` in the dataclasses because OmegaConf matches enum fields by member name.
    """
    from megascale_data_ext.dataplane.mixing import ScheduleType
    from megascale_data_ext.dataplane.strategies import STRATEGIES

    return Rules(
        choices={(MixingConfig, "type"): lambda: [t.value for t in ScheduleType],
                 (StrategyConfig, "name"): lambda: sorted(STRATEGIES)},
        unknown_key_hints={StrategyConfig: " (strategy arguments go under `args`)"},
    )


def _strategy_arg_choices() -> dict[str, Callable[[], list[str]]]:
    """Allowed values of well-known strategy arguments, checked when they are strings."""
    from megascale_data_ext.dataplane.balancers import Level, balancer_names
    from megascale_data_ext.dataplane.costs import TransformerConfig, cost_model_names
    from megascale_data_ext.dataplane.placetree import BucketAxis

    def models() -> list[str]:  # every name the strategies' `get_cost_model` accepts, spelled out
        named = [n for n in cost_model_names() if not n.startswith("vit:")]
        return named + [f"vit:{p}" for p in TransformerConfig.preset_names()]

    axes = [a.value for a in BucketAxis]
    return {
        "model": models,
        "encoder_model": models,
        "method": balancer_names,
        "encoder_method": balancer_names,
        "level": lambda: list(get_args(Level)),
        "axis": lambda: axes,
        "encoder_axis": lambda: axes,
    }


def check_scalars(cfg: MegascaleDataConfig, path: str, problems: Problems, cp: int) -> None:
    """The batch fields, Ray and the mix mode (the runtime's checks), and seq_length against cp."""
    problems.extend(path, cfg.problems())
    mult = cfg.pad_to_multiple_of * 2 * cp
    if not problems.blocked(f"{path}.seq_length") and cfg.pad_to_multiple_of >= 1 and cfg.seq_length % mult:
        fix = (cfg.seq_length // mult + 1) * mult
        problems.add(f"{path}.seq_length", f"{cfg.seq_length} is not a multiple of 2 * pad_to_multiple_of "
                                           f"({cfg.pad_to_multiple_of}) * context_parallel_size ({cp}) = {mult} "
                                           f"(packed microbatches are padded to it); use e.g. {fix}")
    problems.extend(f"{path}.ray", cfg.ray.problems())
    problems.extend(f"{path}.autoscale", cfg.autoscale.problems())
    problems.extend(f"{path}.placement", cfg.placement.problems())
    problems.extend(f"{path}.mixing", choice_problems("mode", cfg.mixing.mode, MIX_MODES))


def _missing_files(fmt: str, path: str) -> str | None:
    """What is absent for one configured path: a glob's matches, the file/dir, or .bin/.idx."""
    if GLOB_CHARS & set(path):
        return None if glob.glob(path, recursive=True) else f"glob {path!r} matches nothing"
    if fmt == "megatron":
        prefix = path.removesuffix(".bin").removesuffix(".idx")
        missing = [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
        return f"Megatron files {missing} do not exist" if missing else None
    return None if os.path.exists(path) else f"{path!r} does not exist"


def check_sources(cfg: MegascaleDataConfig, path: str, problems: Problems, check_paths: bool) -> None:
    """The training sources, then the held-out validation sources (`check_source_list`), which
    share no file with them."""
    where = f"{path}.sources"
    if not cfg.sources and not problems.blocked(where):
        problems.add(where, "is empty: pick a sources group (e.g. `sources=demo_text`) or list sources under it")
    check_source_list(cfg, cfg.sources, where, path, problems, check_paths)
    held_out = cfg.validation.sources
    if not held_out:
        return
    vwhere = f"{path}.validation.sources"
    check_source_list(cfg, held_out, vwhere, path, problems, check_paths)
    trained = {cfg.resolve_path(p): source_name(s, i) for i, s in enumerate(cfg.sources) for p in source_paths(s)}
    for i, s in enumerate(held_out):
        shared = [p for p in source_paths(s) if cfg.resolve_path(p) in trained]
        if shared:
            problems.add(f"{vwhere}[{i}]", f"{shared[0]!r} is also read by training source "
                                           f"{trained[cfg.resolve_path(shared[0])]!r}: validation data must be "
                                           "held out; point it at other files")
    if all(s.weight >= 0 for s in held_out) and sum(s.weight for s in held_out) <= 0:
        problems.add(f"{vwhere}[*].weight", f"weights must sum to > 0, got {[s.weight for s in held_out]!r}")


def check_source_list(cfg: MegascaleDataConfig, sources: list[Any], where: str, path: str, problems: Problems,
                      check_paths: bool) -> None:
    """Paths given once, unique names, SourceSpec's field checks, max_tokens, files on disk."""
    names = [source_name(s, i) for i, s in enumerate(sources)]
    for i, s in enumerate(sources):
        sp, paths = f"{where}[{i}]", source_paths(s)
        if s.path is not None and s.paths:
            problems.add(f"{sp}.path", f"give `path` or `paths`, not both (path={s.path!r}, paths={s.paths!r})")
        elif not paths:
            problems.add(f"{sp}.paths", "is empty: give files, globs, directories or Megatron prefixes")
        if names.count(names[i]) > 1:
            users = [j for j, n in enumerate(names) if n == names[i]]
            problems.add(f"{sp}.name", f"{names[i]!r} is used by sources {users}; names must be unique")
        if s.max_tokens is not None and s.max_tokens > cfg.seq_length:
            problems.add(f"{sp}.max_tokens", f"must be <= {path}.seq_length ({cfg.seq_length}) or null, got "
                                             f"{s.max_tokens!r}: a longer sample cannot be packed; use "
                                             f"`{where}.{names[i]}.max_tokens={cfg.seq_length}` or "
                                             f"`{path}.seq_length={-(-s.max_tokens // 64) * 64}`")
        values = {f.name: getattr(s, f.name) for f in dataclasses.fields(SourceSpec)}
        problems.extend(sp, SourceSpec.field_problems({**values, "name": names[i], "paths": paths or ["-"]}))
        if check_paths:
            for j, p in enumerate(paths):
                at = f"{sp}.path" if s.path is not None else f"{sp}.paths[{j}]"
                miss = _missing_files(s.format, cfg.resolve_path(p))
                if miss and not problems.blocked(at):
                    problems.add(at, f"{miss} (configured {p!r}, data_root={cfg.data_root!r}); "
                                     f"check the path or `{path}.data_root`")
            if s.tokenizer is not None:
                _check_tokenizer(s, cfg.resolve_path(s.tokenizer), sp, problems)


def _check_tokenizer(s: Any, resolved: str, sp: str, problems: Problems) -> None:
    """The tokenizer loads (a file or a directory holding one, of its `tokenizer_type`) at config time."""
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    if not os.path.exists(resolved):
        problems.add(f"{sp}.tokenizer", f"tokenizer file {resolved!r} does not exist")
        return
    try:
        load_tokenizer(resolved, tokenizer_type=s.tokenizer_type, merge_file=s.merge_file, key=f"{sp}.tokenizer")
    except ConfigError as e:
        problems.add(f"{sp}.tokenizer", str(e))


def check_mixing(cfg: MegascaleDataConfig, path: str, problems: Problems) -> None:
    """Source weights that can mix, or a schedule ``build_schedule`` accepts."""
    from megascale_data_ext.dataplane.mixing import WEIGHT_KEYS, build_schedule, required_keys

    where = f"{path}.mixing"
    if problems.blocked(where) or problems.blocked(f"{path}.sources"):
        return
    names = [source_name(s, i) for i, s in enumerate(cfg.sources)]
    if cfg.mixing.type == "constant" and not cfg.mixing.params:
        weights = [s.weight for s in cfg.sources]
        if weights and all(w >= 0 for w in weights) and sum(weights) <= 0:
            problems.add(f"{path}.sources[*].weight", f"weights must sum to > 0, got {weights!r} (sources: {names})")
        return
    if "type" in cfg.mixing.params:
        problems.add(f"{where}.params.type", f"the schedule type goes in `{where}.type`, not in params")
        return
    missing = [k for k in required_keys(cfg.mixing.type) if k not in cfg.mixing.params]
    if missing:  # one override to paste per key: the sources' own weights where a weight per source goes
        weights = "[" + ",".join(f"{s.weight:g}" for s in cfg.sources) + "]"
        sets = " ".join(f"{where}.params.{k}=" + (weights if k in WEIGHT_KEYS else "<value>") for k in missing)
        order = f" (a weight per source, in the order {names})" if any(k in WEIGHT_KEYS for k in missing) else ""
        problems.add(f"{where}.params", f"type {cfg.mixing.type!r} needs {', '.join(missing)}: set `{sets}`{order}")
        return
    try:
        build_schedule({"type": cfg.mixing.type, **cfg.mixing.params}, source_names=names)
    except (ConfigError, TypeError, ValueError) as e:
        problems.add(f"{where}.params", f"{str(e).replace(chr(10), ' ')} (params: {cfg.mixing.params!r})")


def check_strategy(cfg: MegascaleDataConfig, path: str, problems: Problems) -> None:
    """One of name/_target_, importable, known argument names and values, and it builds."""
    from megascale_data_ext.dataplane.strategies import STRATEGIES, strategy_args

    where, sc = f"{path}.strategy", cfg.strategy
    if problems.blocked(where):
        return
    if (sc.name is None) == (sc._target_ is None):
        problems.add(where, f"set exactly one of `name` (one of {sorted(STRATEGIES)}) or `_target_` "
                            f"(a strategy class/factory path), got name={sc.name!r}, _target_={sc._target_!r}")
        return
    if sc._target_ is not None:
        try:
            factory = locate(sc._target_)
        except ConfigError as e:
            problems.add(f"{where}._target_", f"cannot import {sc._target_!r}: {e}")
            return
        name = next((n for n, f in STRATEGIES.items() if f is factory), sc._target_)
    else:
        name, factory = str(sc.name), STRATEGIES[str(sc.name)]
    arg_choices = _strategy_arg_choices() if factory in STRATEGIES.values() else {}  # user classes: own meaning
    for key, value in sc.args.items():
        if key in arg_choices and isinstance(value, str):
            allowed = arg_choices[key]()
            norm = value.upper() if key.endswith("axis") else value.strip().lower() if key.endswith("model") else value
            if key.endswith("model") and norm.startswith(("calibrated:", "transformer:")):
                continue  # a fitted cost model's file or a shape: building the strategy below checks it
            if norm not in allowed:
                problems.add(f"{where}.args.{key}", f"got {value!r}; {did_you_mean(value, allowed)}allowed: {allowed}")
    if name == "hybrid_cp" and cfg.tokens_per_step is not None:
        problems.add(f"{path}.tokens_per_step", "strategy hybrid_cp plans a count of samples a step "
                                                 f"({path}.samples_per_step): set {path}.tokens_per_step=null")
    args = strategy_args(name, sc.args, num_microbatches=cfg.num_microbatches, seq_length=cfg.seq_length)
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in sorted(set(sc.args) - set(params)):
            problems.add(f"{where}.args.{key}", f"{name!r} takes no argument {key!r}; "
                                                f"{did_you_mean(key, list(params))}allowed: {sorted(params)}")
    if not any(p.startswith(f"{where}.args") for p, _ in problems.items):
        try:
            factory(**args)
        except (TypeError, ValueError) as e:
            problems.add(f"{where}.args", f"cannot build strategy {name!r} from {sc.args!r}: {e}")
