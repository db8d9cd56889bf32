"""The `data` Hydra config group: structured schema, eager validation, ServiceConfig.

A Megatron run adopts the service with ``defaults: [data: megascale, strategy: llm_balance,
sources: ..., ray: local]`` (see ``conf/train_gpt.yaml``); :func:`load_config` turns the
composed ``data`` node into a :class:`MegascaleDataConfig` and :meth:`~MegascaleDataConfig.
to_service_config` into the runtime's :class:`~megascale_data_ext.runtime.config.ServiceConfig`.

Modules, each importing only those before it: ``problems`` (Problem, the collector),
``schema`` (the dataclasses, derived from the runtime's), ``coerce`` (node -> dataclasses),
``checks`` (semantic checks), ``load`` (:func:`load_config`), ``hydra`` (conf dir, compose,
ConfigStore: the schema is registered as ``data/megascale_schema`` on import). ``run`` checks
the training run's ``model``, ``train`` and ``parallel`` nodes with the same walk
(:func:`~megascale_data_ext.config.run.load_run_config`).
"""

from megascale_data_ext.config.hydra import compose_config, conf_dir, register_configs
from megascale_data_ext.config.load import load_config
from megascale_data_ext.config.problems import Problem
from megascale_data_ext.config.schema import (
    MegascaleDataConfig,
    MixingConfig,
    SourceConfig,
    StrategyConfig,
    source_config_class,
)
from megascale_data_ext.runtime.config import BatchConfig, RayConfig

__all__ = [
    "BatchConfig",
    "MegascaleDataConfig",
    "MixingConfig",
    "Problem",
    "RayConfig",
    "SourceConfig",
    "StrategyConfig",
    "compose_config",
    "conf_dir",
    "load_config",
    "register_configs",
    "source_config_class",
]

register_configs()
