"""megascale_data_ext: a disaggregated, parallelism-aware, multi-source data service for Megatron.

The public surface, importable from the package root::

    from megascale_data_ext import ClientPlaceTree, DGraph, DataService, Client, install, load_config

Internals live in `dataplane` (numpy only), `sources`, `runtime` (the actors' plain classes,
their Ray façades and the trainer-side client), `config` and `megatron`.

Names are resolved on first use (PEP 562): every Ray actor imports this package's root, and
an eager root would load torch, Ray and Hydra into processes that need none of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # the data plane
    "ClientPlaceTree": "megascale_data_ext.dataplane.placetree",
    "DGraph": "megascale_data_ext.dataplane.dgraph",
    "StepPlan": "megascale_data_ext.dataplane.plan",
    "LLMBalance": "megascale_data_ext.dataplane.strategies",
    "VLMBalance": "megascale_data_ext.dataplane.strategies",
    "Vanilla": "megascale_data_ext.dataplane.strategies",
    "build_strategy": "megascale_data_ext.dataplane.strategies",
    "register_strategy": "megascale_data_ext.dataplane.strategies",
    "Mixer": "megascale_data_ext.dataplane.mixing",
    "build_schedule": "megascale_data_ext.dataplane.mixing",
    "TransformerConfig": "megascale_data_ext.dataplane.costs",
    # sources
    "SourceSpec": "megascale_data_ext.sources.base",
    "prepare": "megascale_data_ext.sources.prepare",
    # the runtime
    "ServiceConfig": "megascale_data_ext.runtime.config",
    "ServiceTopology": "megascale_data_ext.runtime.topology",
    "ServiceHandles": "megascale_data_ext.runtime.handles",
    "SourceLoader": "megascale_data_ext.runtime.loader",
    "Planner": "megascale_data_ext.runtime.planner",
    "DataConstructor": "megascale_data_ext.runtime.constructor",
    "DataService": "megascale_data_ext.runtime.service",
    "InProcessService": "megascale_data_ext.runtime.inprocess",
    "Client": "megascale_data_ext.runtime.client",
    "FaultToleranceConfig": "megascale_data_ext.runtime.fault_tolerance",
    "ServiceUnavailableError": "megascale_data_ext.errors",
    # state and errors
    "Stateful": "megascale_data_ext.state",
    "StateSchema": "megascale_data_ext.state",
    "ConfigError": "megascale_data_ext.errors",
    "ParallelLayoutError": "megascale_data_ext.errors",
    "PlanError": "megascale_data_ext.errors",
    "CapacityError": "megascale_data_ext.errors",
    "SourceError": "megascale_data_ext.errors",
    "SampleError": "megascale_data_ext.errors",
    "ResumeError": "megascale_data_ext.errors",
    # configuration and Megatron integration
    "load_config": "megascale_data_ext.config",
    "compose_config": "megascale_data_ext.config",
    "install": "megascale_data_ext.megatron.hooks",
    "MegascaleDatasetBuilder": "megascale_data_ext.megatron.builder",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # static checkers and IDEs see real imports
    from megascale_data_ext.config import compose_config, load_config
    from megascale_data_ext.dataplane.costs import TransformerConfig
    from megascale_data_ext.dataplane.dgraph import DGraph
    from megascale_data_ext.dataplane.mixing import Mixer, build_schedule
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.dataplane.plan import StepPlan
    from megascale_data_ext.dataplane.strategies import (
        LLMBalance,
        Vanilla,
        VLMBalance,
        build_strategy,
        register_strategy,
    )
    from megascale_data_ext.errors import (
        CapacityError,
        ConfigError,
        ParallelLayoutError,
        PlanError,
        ResumeError,
        SampleError,
        SourceError,
    )
    from megascale_data_ext.megatron.builder import MegascaleDatasetBuilder
    from megascale_data_ext.megatron.hooks import install
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.runtime.config import ServiceConfig
    from megascale_data_ext.runtime.constructor import DataConstructor
    from megascale_data_ext.runtime.handles import ServiceHandles
    from megascale_data_ext.runtime.inprocess import InProcessService
    from megascale_data_ext.runtime.loader import SourceLoader
    from megascale_data_ext.runtime.planner import Planner
    from megascale_data_ext.runtime.service import DataService
    from megascale_data_ext.runtime.topology import ServiceTopology
    from megascale_data_ext.sources.base import SourceSpec
    from megascale_data_ext.sources.prepare import prepare
    from megascale_data_ext.state import Stateful, StateSchema


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
