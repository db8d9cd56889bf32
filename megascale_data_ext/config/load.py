"""``load_config``: a ``data`` node, checked all at once, as a :class:`MegascaleDataConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megascale_data_ext.config.checks import check_mixing, check_scalars, check_sources, check_strategy, rules
from megascale_data_ext.config.coerce import build, to_plain
from megascale_data_ext.config.problems import Problems
from megascale_data_ext.config.schema import MegascaleDataConfig


def load_config(
    cfg: Any, *, path: str = "data", check_paths: bool = True, context_parallel_size: int = 1
) -> MegascaleDataConfig:
    """Validate a ``data`` node eagerly and build the structured config.

    Args:
        cfg: The ``data`` DictConfig/mapping (a whole composed config with a ``data`` key is
            accepted too), or a :class:`MegascaleDataConfig`.
        path: Config path prefix used in messages.
        check_paths: Check that source and tokenizer files exist (off when the data lives
            only on the cluster the config is sent to).
        context_parallel_size: Megatron's CP size; ``seq_length`` must divide by
            ``2 * pad_to_multiple_of * cp`` because CP slicing splits each sequence in 2·cp.

    A whole config's ``model`` node gives the strategy's cost model unless ``data.strategy.args.model``
    names one (`derive_cost_model`).

    Raises:
        ConfigError: listing every problem, each as ``path: message`` with the bad value and
            the allowed values.
    """
    problems = Problems()
    model = None
    if isinstance(cfg, Mapping) and "data" in cfg and "sources" not in cfg:  # a whole composed config
        cfg, model = cfg["data"], cfg.get("model")
    built = build(MegascaleDataConfig, to_plain(cfg, path, problems), path, problems, rules())
    if built is not None and not problems.blocked(f"{path}.strategy"):
        derive_cost_model(built, model)
    check_scalars(built, path, problems, max(1, int(context_parallel_size)))
    check_sources(built, path, problems, check_paths)
    check_mixing(built, path, problems)
    check_strategy(built, path, problems)
    problems.raise_if_any()
    return built


def derive_cost_model(data: MegascaleDataConfig, model: Any) -> None:
    """One place for the model's shape: with ``data.strategy.args.model`` unset (null), the strategy
    costs samples with the config's own ``model.num_layers/hidden_size/num_attention_heads``
    (``transformer:layers=..,hidden=..,heads=..``); without a ``model`` node, the strategy's default."""
    args = data.strategy.args
    if args.get("model") is not None:
        return
    args.pop("model", None)
    if not _takes_model(data.strategy):  # a user's strategy class without a cost model: nothing to give it
        return
    shape = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads"}
    values = {k: (model.get(v) if model is not None else None) for k, v in shape.items()}
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()):
        from megascale_data_ext.dataplane.costs import shape_name

        args["model"] = shape_name(**values)


def _takes_model(strategy: Any) -> bool:
    """Whether the strategy's factory has a ``model`` argument (unresolvable ones: `check_strategy` says why)."""
    import inspect

    from megascale_data_ext.config.schema import locate
    from megascale_data_ext.dataplane.strategies import STRATEGIES

    try:
        factory = STRATEGIES[str(strategy.name)] if strategy._target_ is None else locate(strategy._target_)
        return "model" in inspect.signature(factory).parameters
    except Exception:  # noqa: BLE001 - an unknown name or target is reported by check_strategy
        return False

