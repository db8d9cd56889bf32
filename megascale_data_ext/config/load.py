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

    Raises:
        ConfigError: listing every problem, each as ``path: message`` with the bad value and
            the allowed values.
    """
    problems = Problems()
    if isinstance(cfg, Mapping) and "data" in cfg and "sources" not in cfg:  # a whole composed config
        cfg = cfg["data"]
    built = build(MegascaleDataConfig, to_plain(cfg, path, problems), path, problems, rules())
    check_scalars(built, path, problems, max(1, int(context_parallel_size)))
    check_sources(built, path, problems, check_paths)
    check_mixing(built, path, problems)
    check_strategy(built, path, problems)
    problems.raise_if_any()
    return built
