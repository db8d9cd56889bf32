"""The Megatron-Bridge provider: Bridge's batch format from a real in-process service, its checks, and
the provider class built over Bridge's `DatasetProvider` (a stand-in module: importing Bridge needs
Transformer Engine, which a CPU box lacks).

What Bridge does with a batch is re-done here from its source (megatron-bridge 0.3.1,
``training/gpt_step.py`` and ``training/utils/packed_seq_utils.py``): the padded boundaries are
``cu_seqlens[:cu_seqlens_argmin]``, the real ones ``cu_seqlens_unpadded[:cu_seqlens_unpadded_argmin]``,
and with CP > 1 each rank keeps Transformer Engine's ``thd_get_partitioned_indices`` of the whole
pack (this project's `thd_partition_index`, tested against Megatron's own slicing elsewhere).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from abc import ABC, abstractmethod

import numpy as np
import pytest

from megascale_data_ext import Client, ClientPlaceTree, InProcessService, ServiceConfig
from megascale_data_ext.dataplane.cp_slicing import slice_for_cp, thd_partition_index
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.megatron import bridge
from megascale_data_ext.megatron.provider import ProviderConfig
from megascale_data_ext.sources.demo_data import make_demo_data
from tests.unit.test_provider import fake_parallel_state


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=7, rows=40, text_sources=2, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True) for s in out]


def service(specs, tree: ClientPlaceTree, **strategy_args) -> InProcessService:
    return InProcessService(ServiceConfig(sources=specs, seed=3, samples_per_step=8, num_microbatches=2,
                                          seq_length=1024, strategy="llm_balance",
                                          strategy_args={"model": "gpt-tiny", **strategy_args}, buffer_size=32),
                            tree)


def bridge_packed(batch) -> tuple[np.ndarray, np.ndarray]:
    """(padded, real) boundaries as Bridge's `get_packed_seq_params` reads them."""
    padded = batch["cu_seqlens"].squeeze()[: batch["cu_seqlens_argmin"].item()].numpy()
    real = batch.get("cu_seqlens_unpadded")
    real = padded if real is None else real.squeeze()[: batch["cu_seqlens_unpadded_argmin"].item()].numpy()
    return padded, real


def test_whole_packs_at_cp2_give_every_rank_megatrons_slice_when_bridge_cuts_them(specs) -> None:
    tree = ClientPlaceTree.from_sizes(cp=2, dp=2)
    whole = service(specs, tree, broadcast=["tp", "cp"])
    fetcher = Client(whole.topology, 0, source=whole, num_microbatches=2, broadcast=False, cp_slice=False)
    for _ in range(4):
        pack = fetcher.next_microbatch()
        view = bridge.bridge_view(pack, cp_size=2)
        padded, real = bridge_packed(view)
        assert np.array_equal(real, pack["cu_seqlens"].numpy())  # attention's real document boundaries
        assert np.all(np.diff(padded) % 4 == 0) and padded[-1] == view["tokens"].shape[1]
        assert view["max_seqlen"].item() == np.diff(padded).max()
        for cp_rank in range(2):  # Bridge's CP cut of the whole pack == what Megatron-LM's path gets
            want = slice_for_cp({k: v.numpy() for k, v in pack.items()}, cp_size=2, cp_rank=cp_rank)
            index = thd_partition_index(padded, 2, cp_rank)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                np.testing.assert_array_equal(view[key].numpy()[:, index], want[key])


def test_view_at_cp1_keeps_boundaries_and_fills_a_stages_missing_fields(specs) -> None:
    tree = ClientPlaceTree.from_sizes(pp=2, dp=2)
    svc = service(specs, tree)
    first = svc.topology.fetch_ranks()[0]
    view = bridge.bridge_view(Client(svc.topology, first, source=svc, num_microbatches=2, broadcast=False,
                                     cp_slice=False).next_microbatch())
    padded, real = bridge_packed(view)
    assert np.array_equal(padded, real) and "cu_seqlens_unpadded" not in view
    assert padded[-1] == view["tokens"].shape[1] and view["max_seqlen"].item() == np.diff(padded).max()
    assert view["tokens"].shape[0] == 1  # micro-batch 1, as Bridge's collate would give
    last = [r for r in svc.topology.fetch_ranks() if tree.coords(r)["pp"] == 1][0]
    view = bridge.bridge_view(Client(svc.topology, last, source=svc, num_microbatches=2, broadcast=False,
                                     cp_slice=False).next_microbatch())
    assert view["tokens"] is None and view["position_ids"] is None  # the last stage gets labels, loss mask
    assert view["labels"] is not None and view["loss_mask"] is not None


def test_topology_checks_name_the_override(specs) -> None:
    at_cp2 = ClientPlaceTree.from_sizes(cp=2, dp=2)
    tp_only = service(specs, at_cp2).topology
    with pytest.raises(ConfigError, match=r"data.strategy.args.broadcast=\[tp,cp\]"):
        bridge.bridge_topology(at_cp2, ProviderConfig(namespace="x", topology=tp_only))
    assert bridge.bridge_topology(at_cp2, ProviderConfig(
        namespace="x", topology=service(specs, at_cp2, broadcast=["tp", "cp"]).topology)) is not None
    with pytest.raises(ConfigError, match="but Megatron-Bridge runs"):
        bridge.bridge_topology(ClientPlaceTree.from_sizes(dp=4), ProviderConfig(namespace="x", topology=tp_only))
    vpp = ClientPlaceTree.from_sizes(pp=2, vpp=2, dp=1)
    with pytest.raises(ConfigError, match="no virtual pipeline"):
        bridge.bridge_topology(vpp, ProviderConfig(namespace="x", topology=service(specs, vpp).topology))


def test_a_feedback_mixing_service_is_refused_by_trainers_that_report_no_loss(specs) -> None:
    """Megatron-LM's and Bridge's loops send no per-source loss: a service that mixes by loss feedback
    would wait forever at step d; the topology `DataService` stamps says so and both providers refuse
    it in one line naming the override."""
    from megascale_data_ext.megatron.provider import find_topology
    from megascale_data_ext.runtime.service import DataService

    tree = ClientPlaceTree.from_sizes(dp=2)
    mixing = {"type": "feedback", "base_weights": [1.0, 1.0], "delay": 3}
    base = ServiceConfig(sources=specs, seed=3, samples_per_step=8, num_microbatches=2, seq_length=1024,
                         strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=32)
    feedback = DataService(dataclasses.replace(base, mixing=mixing), tree, progress=None).topology
    assert feedback.report_delay == 3
    for trainer in ("Megatron-LM", "Megatron-Bridge"):
        with pytest.raises(ConfigError, match=f"mixes by loss feedback .*which {trainer}'s training loop does not "
                                              r"report: start it with data.mixing.type=constant"):
            find_topology(tree, ProviderConfig(namespace="x", topology=feedback), trainer=trainer)
    static = DataService(base, tree, progress=None).topology
    assert static.report_delay is None and bridge.bridge_topology(tree, ProviderConfig(namespace="x",
                                                                                       topology=static))


@pytest.fixture
def bridge_module(monkeypatch: pytest.MonkeyPatch):
    """``megatron.bridge.training.config`` as far as the provider uses it (Bridge 0.3.1's shapes)."""

    @dataclasses.dataclass(kw_only=True)
    class DataloaderConfig:
        dataloader_type: str | None = None
        num_workers: int = 8

    @dataclasses.dataclass
    class DatasetProvider(DataloaderConfig, ABC):
        @abstractmethod
        def build_datasets(self, context):
            ...

    mod = types.ModuleType("megatron.bridge.training.config")
    mod.DatasetProvider = DatasetProvider
    monkeypatch.setitem(sys.modules, "megatron.bridge.training.config", mod)
    bridge._provider_class.cache_clear()
    yield mod
    bridge._provider_class.cache_clear()


def test_provider_is_bridges_and_builds_a_fetching_ranks_iterator(specs, bridge_module, monkeypatch) -> None:
    tree = ClientPlaceTree.from_sizes(dp=2)
    svc = service(specs, tree)
    provider = bridge.bridge_provider(ProviderConfig(namespace="svc", topology=svc.topology), num_microbatches=2,
                                      start_step=1)
    assert isinstance(provider, bridge_module.DatasetProvider) and provider.dataloader_type == "external"
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake_parallel_state(1, tp=1, pp=1, dp=2))
    monkeypatch.setattr(bridge, "broadcast_group", lambda topology: None)  # TP 1: nobody to broadcast to
    monkeypatch.setattr(bridge, "remote_source", lambda topology, config: svc)  # the service, in-process
    train, valid, test = provider.build_datasets(types.SimpleNamespace(train_samples=8, valid_samples=0,
                                                                       test_samples=0, tokenizer=None))
    assert valid is None and test is None and isinstance(train, bridge.BridgeIterator)
    got = next(train)
    want, _ = svc.get(1, 0, 1)  # rank 1 = DP rank 1, resumed at step 1
    np.testing.assert_array_equal(got["tokens"].numpy(), want["tokens"])
    assert train.state_dict()["step"] == 1 and train.state_dict()["microbatch"] == 1


def test_without_bridge_the_provider_names_the_package(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.bridge.training.config", None)  # import fails
    bridge._provider_class.cache_clear()
    try:
        with pytest.raises(ConfigError, match="install megatron-bridge"):
            bridge.bridge_provider(ProviderConfig(namespace="x"), num_microbatches=1)
    finally:
        bridge._provider_class.cache_clear()
