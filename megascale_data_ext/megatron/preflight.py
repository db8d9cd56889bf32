"""Checks a training run can make before torch and megatron-core are imported.

Importing megatron-core takes 15–40 s per rank; a world size that does not divide by
tp·pp·cp, a bad data config or an unreachable Ray address is known from the composed config
and the launcher's environment alone. :func:`preflight` reports all of those at once, naming
the config keys, in well under a second — before any rank pays for the heavy imports.

Imports: the config package (Hydra, OmegaConf) and the Ray address probe; no torch, no Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from megascale_data_ext.errors import ConfigError, ParallelLayoutError

_PARALLEL_KEYS = {
    "tp": "parallel.tensor_model_parallel_size",
    "pp": "parallel.pipeline_model_parallel_size",
    "cp": "parallel.context_parallel_size",
    "vpp": "parallel.virtual_pipeline_model_parallel_size",
}


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    value = node.get(key, default) if isinstance(node, Mapping) or hasattr(node, "get") else default
    return default if value is None else value


def _int(node: Any, key: str, path: str, default: int | None, problems: list[str]) -> int | None:
    value = _get(node, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"`{path}` must be an integer >= 1, got {value!r}")
        return None
    return value


def world_size_from_env() -> int:
    """The launcher's world size (torchrun sets WORLD_SIZE; a plain `python` run is 1)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={raw!r} is not an integer; launch with torchrun") from None


def layout_problems(cfg: Any, world_size: int) -> list[str]:
    """Every reason the `parallel` and `model` nodes cannot describe `world_size` ranks."""
    parallel, model = _get(cfg, "parallel"), _get(cfg, "model")
    problems: list[str] = []
    tp = _int(parallel, "tensor_model_parallel_size", _PARALLEL_KEYS["tp"], 1, problems)
    pp = _int(parallel, "pipeline_model_parallel_size", _PARALLEL_KEYS["pp"], 1, problems)
    cp = _int(parallel, "context_parallel_size", _PARALLEL_KEYS["cp"], 1, problems)
    vpp = _int(parallel, "virtual_pipeline_model_parallel_size", _PARALLEL_KEYS["vpp"], None, problems)
    if None in (tp, pp, cp):
        return problems
    group = tp * pp * cp
    if world_size % group:
        below = world_size // group * group
        fits = [n for n in (below, below + group) if n]
        problems.append(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {group} "
            f"({_PARALLEL_KEYS['tp']}, {_PARALLEL_KEYS['pp']}, {_PARALLEL_KEYS['cp']}): launch "
            f"a multiple of {group} ranks (e.g. {' or '.join(map(str, fits))}) "
            "or change those sizes")
    if vpp is not None and (vpp < 2 or pp < 2):
        problems.append(f"`{_PARALLEL_KEYS['vpp']}`={vpp} needs a value >= 2 and "
                        f"`{_PARALLEL_KEYS['pp']}` >= 2 (it is {pp}); set it to null otherwise")
    layers = _int(model, "num_layers", "model.num_layers", None, problems)
    heads = _int(model, "num_attention_heads", "model.num_attention_heads", None, problems)
    hidden = _int(model, "hidden_size", "model.hidden_size", None, problems)
    chunks = pp * (vpp or 1)
    if layers is not None and layers % chunks:
        problems.append(f"`model.num_layers`={layers} does not split evenly over pp*vpp = {chunks} model chunks; "
                        f"use a multiple of {chunks}")
    if heads is not None and heads % tp:
        problems.append(f"`model.num_attention_heads`={heads} is not divisible by "
                        f"`{_PARALLEL_KEYS['tp']}`={tp}; use a multiple of {tp}")
    if heads is not None and hidden is not None and hidden % heads:
        problems.append(f"`model.hidden_size`={hidden} is not divisible by `model.num_attention_heads`={heads}")
    return problems


def preflight(cfg: Any, *, world_size: int | None = None, check_ray: bool = True,
              ray_probe_seconds: float | None = None) -> None:
    """Raise one error listing every start-up problem of a training config, before heavy imports.

    Checks the ``model``, ``train`` and ``parallel`` nodes (`config.run.load_run_config`), the
    parallel layout against the launcher's world size, the whole `data` node
    (schema, source files, strategy, mixing: :func:`megascale_data_ext.config.load_config`)
    and that `data.ray.address`, when set to host:port, answers within a bounded time.
    """
    from megascale_data_ext.config.run import load_run_config

    load_run_config(cfg)  # model/train/parallel: unknown keys, types, ranges (all at once)
    world = world_size_from_env() if world_size is None else world_size
    layout = layout_problems(cfg, world)
    if layout:
        raise ParallelLayoutError("the run cannot start: " + "; ".join(layout))
    data = _get(cfg, "data")
    if data is None:
        raise ConfigError("the composed config has no `data` node; add `data: megascale` to its defaults list")
    from megascale_data_ext.config import load_config

    cp = int(_get(_get(cfg, "parallel"), "context_parallel_size", 1))
    whole = isinstance(cfg, Mapping) and _get(cfg, "model") is not None  # its `model` gives the cost model
    loaded = load_config(cfg if whole else data, context_parallel_size=cp)
    eval_interval = int(_get(_get(cfg, "train"), "eval_interval", 0) or 0)
    if eval_interval > 0 and not loaded.validation.sources:
        raise ConfigError(f"`train.eval_interval`={eval_interval} needs held-out sources to evaluate on: list them "
                          "under `data.validation.sources` (same keys as data.sources), or set train.eval_interval=0")
    if check_ray:
        from megascale_data_ext.runtime.ray_address import PROBE_SECONDS, check_reachable

        check_reachable(_get(_get(data, "ray"), "address"), seconds=ray_probe_seconds or PROBE_SECONDS)
