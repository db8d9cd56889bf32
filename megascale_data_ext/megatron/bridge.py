"""A Megatron-Bridge dataset provider: NeMo's Megatron trainer reading from the service.

Megatron-Bridge (0.3.x, megatron-core 0.15-0.16) takes a ``DatasetProvider`` as its
``ConfigContainer.dataset``: Bridge calls ``build_datasets(context)`` on every rank and, with
``dataloader_type="external"``, wraps what it returns in ``RerunDataIterator`` and calls
``next()`` once per microbatch. Its ``gpt_step.get_batch`` differs from Megatron-LM's in what a
provider must hand over:

* every rank of the first and last pipeline stage calls ``next()`` itself (no broadcast over TP
  in the trainer), so the client fetches on TP rank 0 and broadcasts over TP;
* with CP > 1 Bridge cuts each rank's CP share of a packed microbatch itself (Transformer
  Engine's ``thd_get_partitioned_indices``), so every CP rank needs the whole pack: the service
  must fetch once per TP x CP group (``data.strategy.args.broadcast=[tp,cp]``), and the client
  hands the whole pack on, each document padded to a multiple of 2·cp (`pad_for_cp`);
* packed boundaries travel as ``cu_seqlens`` (padded) with ``cu_seqlens_argmin`` (its length: no
  ``-1`` padding), ``cu_seqlens_unpadded`` / ``cu_seqlens_unpadded_argmin`` where they differ,
  and ``max_seqlen`` as a host tensor; every key ``get_batch`` indexes is present (None where a
  stage reads nothing).

Importing Bridge needs Transformer Engine and ``transformers`` (its LoRA layers import TE), so the
provider class is made on first use (`bridge_provider`); the iterator and the batch format are
plain code, tested without Bridge. Interleaved pipelines are refused: Bridge calls the provider
once per model chunk without saying which.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megascale_data_ext.dataplane.cp_slicing import pad_for_cp
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.megatron.groups import broadcast_group
from megascale_data_ext.megatron.provider import (
    MEGATRON_REQUIRED_FIELDS,
    ProviderConfig,
    find_topology,
    global_rank,
    remote_source,
)
from megascale_data_ext.runtime.client import Client, MicrobatchSource, to_torch
from megascale_data_ext.runtime.topology import ServiceTopology

__all__ = ["BridgeIterator", "bridge_provider", "bridge_topology", "bridge_view"]


def bridge_view(batch: Mapping[str, torch.Tensor], *, cp_size: int = 1) -> dict[str, torch.Tensor | None]:
    """A service microbatch (a whole pack) in the form Megatron-Bridge's ``get_batch`` reads."""
    arrays = {k: v.numpy() for k, v in batch.items()}
    if cp_size > 1 and arrays.get("cu_seqlens") is not None:
        arrays = pad_for_cp(arrays, cp_size=cp_size)
    out: dict[str, torch.Tensor | None] = dict(to_torch({k: v for k, v in arrays.items()
                                                         if k not in ("cu_seqlens", "cu_seqlens_padded")}))
    for key in MEGATRON_REQUIRED_FIELDS:
        out.setdefault(key, None)  # a stage's own fields only; get_batch indexes all four
    real = arrays.get("cu_seqlens")
    if real is not None:
        real = np.asarray(real, dtype=np.int32).reshape(-1)
        padded = np.asarray(arrays.get("cu_seqlens_padded", real), dtype=np.int32).reshape(-1)
        out["cu_seqlens"] = torch.from_numpy(padded.copy()).unsqueeze(0)
        out["cu_seqlens_argmin"] = torch.tensor(len(padded))  # nothing to cut: no -1 padding
        if not np.array_equal(padded, real):
            out["cu_seqlens_unpadded"] = torch.from_numpy(real.copy()).unsqueeze(0)
            out["cu_seqlens_unpadded_argmin"] = torch.tensor(len(real))
        out["max_seqlen"] = torch.tensor(int(np.diff(padded).max(initial=0)), dtype=torch.int32)
    return out


class BridgeIterator(Iterator[dict[str, torch.Tensor | None]]):
    """One rank's endless iterator over (step, microbatch) for Bridge's training loop.

    Args:
        client: The rank's client, broadcasting over the service's broadcast group and
            handing whole packs on (``cp_slice=False``).
    """

    __slots__ = ("client",)

    def __init__(self, client: Client) -> None:
        if client.cp_slice:
            raise ConfigError("the Bridge provider's client must hand whole packs on (Bridge cuts CP slices)")
        self.client = client

    def __iter__(self) -> BridgeIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor | None]:
        batch = self.client.next_microbatch()
        return bridge_view(batch or {}, cp_size=self.client.topology.tree.cp)

    def state_dict(self) -> dict[str, Any]:
        return self.client.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.client.load_state_dict(state)


def bridge_topology(tree: ClientPlaceTree, config: ProviderConfig) -> ServiceTopology:
    """The running service's topology, checked against what Bridge's ``get_batch`` needs."""
    topology = find_topology(tree, config, trainer="Megatron-Bridge")
    if tree.vpp:
        raise ConfigError("Megatron-Bridge calls a dataset provider once per model chunk without naming the chunk: "
                          "the service's Bridge provider supports no virtual pipeline (set "
                          "virtual_pipeline_model_parallel_size to None) — Megatron-LM's path (serve) does")
    want = {"tp", "cp"} if tree.cp > 1 else {"tp"}
    if set(topology.broadcast_dims) != want:
        raise ConfigError(f"the data service broadcasts along {list(topology.broadcast_dims)}, but Megatron-Bridge "
                          f"needs whole packs on every rank of a {'TP x CP' if tree.cp > 1 else 'TP'} group: start "
                          f"it with data.strategy.args.broadcast=[{','.join(sorted(want, reverse=True))}]")
    return topology


def bridge_iterator(config: ProviderConfig, *, num_microbatches: int, start_step: int = 0,
                    source: MicrobatchSource | None = None) -> BridgeIterator:
    """This rank's iterator over the service `config` names (call after Megatron's parallel init)."""
    tree = ClientPlaceTree.from_megatron()
    topology = bridge_topology(tree, config)
    rank = global_rank()
    fetches = topology.fetches(rank) and topology.needs_data(rank)
    if fetches and source is None:
        source = remote_source(topology, config)
    client = Client(topology, rank, source=source if fetches else None, num_microbatches=num_microbatches,
                    broadcast_group=broadcast_group(topology), cp_slice=False)
    client.seek(start_step)
    return BridgeIterator(client)


@functools.cache
def _provider_class() -> type:
    """Bridge's ``DatasetProvider`` subclassed (made on first use: importing Bridge needs TE)."""
    try:
        bridge_config = importlib.import_module("megatron.bridge.training.config")
    except ImportError as exc:
        raise ConfigError(f"Megatron-Bridge is not importable ({exc}); install megatron-bridge>=0.3 "
                          "(it needs Transformer Engine)") from exc

    @dataclass(kw_only=True)
    class MegascaleDataProvider(bridge_config.DatasetProvider):
        """The service as Bridge's dataset (``dataloader_type="external"``)."""

        namespace: str
        address: str | None = None
        num_microbatches: int = 1
        start_step: int = 0
        valid_namespace: str | None = None
        valid_start_step: int = 0
        dataloader_type: str = "external"
        topology: Any = field(default=None, repr=False)

        def build_datasets(self, context: Any) -> tuple[Any, Any, Any]:
            del context  # sample counts: the service plans steps forever, Bridge stops at train_iters
            config = ProviderConfig(namespace=self.namespace, address=self.address, topology=self.topology)
            train = bridge_iterator(config, num_microbatches=self.num_microbatches, start_step=self.start_step)
            valid = None
            if self.valid_namespace:
                valid = bridge_iterator(ProviderConfig(namespace=self.valid_namespace, address=self.address),
                                        num_microbatches=self.num_microbatches, start_step=self.valid_start_step)
            return train, valid, None

    return MegascaleDataProvider


def bridge_provider(service: Any, *, num_microbatches: int, start_step: int = 0,
                    valid_namespace: str | None = None, valid_start_step: int = 0) -> Any:
    """A Megatron-Bridge ``DatasetProvider`` over a running service: ``ConfigContainer(dataset=...)``.

    Args:
        service: `ServiceHandles` (from `DataService.start()`) or a `ProviderConfig`.
        num_microbatches: Microbatches per step per DP rank (the service's and Bridge's).
        start_step: First step to fetch: the checkpoint's iteration when Bridge resumes.
        valid_namespace: Namespace of a validation service (``serve`` prints it), for Bridge's evaluation.
        valid_start_step: Its first step (``iteration // eval_interval * eval_iters`` on a resume).
    """
    config = service if isinstance(service, ProviderConfig) else ProviderConfig.from_handles(service)
    return _provider_class()(namespace=config.namespace, address=config.address, topology=config.topology,
                             num_microbatches=num_microbatches, start_step=start_step,
                             valid_namespace=valid_namespace, valid_start_step=valid_start_step)
