"""The `--dataloader-type external` provider over a mocked `parallel_state`, a real Client and a fake source."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from megascale_data_ext import Client, ClientPlaceTree, ServiceTopology
from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.errors import ConfigError, ParallelLayoutError, ResumeError
from megascale_data_ext.megatron import provider as prov
from megascale_data_ext.megatron.provider import MicrobatchIterator, ProviderConfig, megatron_view
from tests.harness import check_save_load

RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator
ORDER = "tp-cp-ep-dp-pp"


def fake_parallel_state(rank: int, *, tp: int, pp: int, dp: int, cp: int = 1,
                        vpp: int | None = None) -> types.ModuleType:
    """parallel_state after initialize_model_parallel, with groups from Megatron's own RankGenerator."""
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)
    groups = {tok: next(g for g in gen.get_ranks(tok) if rank in g) for tok in ("tp", "cp", "dp", "pp", "dp-cp")}
    ps = types.ModuleType("megatron.core.parallel_state")
    ps.__dict__.update(
        model_parallel_is_initialized=lambda: True,
        get_tensor_model_parallel_world_size=lambda: tp,
        get_pipeline_model_parallel_world_size=lambda: pp,
        get_context_parallel_world_size=lambda: cp,
        get_data_parallel_world_size=lambda: dp,
        get_expert_model_parallel_world_size=lambda: 1,
        get_expert_tensor_parallel_world_size=lambda: tp,
        get_virtual_pipeline_model_parallel_world_size=lambda: vpp,
        get_tensor_model_parallel_rank=lambda: groups["tp"].index(rank),
        get_pipeline_model_parallel_rank=lambda: groups["pp"].index(rank),
        get_context_parallel_rank=lambda: groups["cp"].index(rank),
        get_data_parallel_rank=lambda: groups["dp"].index(rank),
        get_expert_model_parallel_rank=lambda: 0,
        _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS=groups["tp"],
        _PIPELINE_GLOBAL_RANKS=groups["pp"],
        _DATA_PARALLEL_GLOBAL_RANKS=groups["dp"],
        _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP=groups["dp-cp"],
        _CONTEXT_PARALLEL_GLOBAL_RANKS=groups["cp"],
    )
    return ps


class FakeSource:
    """Stands in for the service: microbatch (step, j) of rank r is tokens [[step, j, r]]."""

    built: list[ServiceTopology] = []  # topology of every source built (fetching ranks only)

    def __init__(self, topology: ServiceTopology, config: ProviderConfig) -> None:
        FakeSource.built.append(topology)

    def get(self, step: int, microbatch: int, rank: int):
        t = np.asarray([[step, microbatch, rank]], dtype=np.int64)
        return ({"tokens": t, "labels": t + 1, "loss_mask": np.ones((1, 3), np.float32),
                 "position_ids": np.arange(3)[None], "cu_seqlens": np.asarray([0, 3], np.int32)},
                {"step": step, "microbatch": microbatch})


def own_topology(tree: ClientPlaceTree, config: ProviderConfig) -> ServiceTopology:
    """The topology a service started for this layout would have (one constructor per DP rank)."""
    n = tree.buckets("DP").num_buckets
    return ServiceTopology(tree=tree, distribution=Distribution(), constructor_groups=tuple((b,) for b in range(n)),
                           num_sources=1, namespace=config.namespace)


def configure(config: ProviderConfig, **kw: Any) -> prov.DatasetProvider:
    return prov.configure(config, source_factory=FakeSource, topology_factory=own_topology, **kw)


def client(rank: int = 0, num_microbatches: int = 4) -> Client:
    tree = ClientPlaceTree.from_sizes(dp=2)
    return Client(own_topology(tree, ProviderConfig(namespace="ns")), rank, source=FakeSource(None, None),
                  num_microbatches=num_microbatches, broadcast=False)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    FakeSource.built = []
    for var in (prov.ENV_NAMESPACE, prov.ENV_RAY_ADDRESS, prov.ENV_NUM_MICROBATCHES, prov.ENV_START_STEP,
                prov.ENV_VALID_NAMESPACE):
        monkeypatch.delenv(var, raising=False)
    prov.reset()
    yield
    prov.reset()


def build_on(provider: prov.DatasetProvider, monkeypatch: pytest.MonkeyPatch, rank: int, vp_stage: int | None = None,
             **layout: Any):
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake_parallel_state(rank, **layout))
    return provider([100, 10, 10], vp_stage=vp_stage)


def test_provider_is_distributed_and_only_fetching_ranks_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prov.train_valid_test_datasets_provider.is_distributed is True
    provider = configure(ProviderConfig(namespace="ns", num_microbatches=3, start_step=5))
    fetching = []
    for rank in range(8):  # tp=2, pp=2, dp=2: ranks 0..3 stage 0, 4..7 stage 1; tp rank = rank % 2
        train, valid, test = build_on(provider, monkeypatch, rank, tp=2, pp=2, dp=2)
        assert isinstance(train, MicrobatchIterator) and valid is None and test is None
        assert (train.step, train.microbatch) == (5, 0)
        if train.fetches:
            fetching.append(rank)
        else:
            assert [next(train) for _ in range(4)] == [None] * 4
            assert (train.step, train.microbatch) == (6, 1)  # non-fetchers still count
    # Exactly the ranks on which Megatron's get_batch calls next(): TP rank 0 of first and last stage.
    assert fetching == [0, 2, 4, 6]
    assert len(FakeSource.built) == len(fetching)


def test_providers_keep_their_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two services, two providers: each call uses its own provider's settings (no module state)."""
    early = configure(ProviderConfig(namespace="a", num_microbatches=3, start_step=2))
    late = configure(ProviderConfig(namespace="b", num_microbatches=2, start_step=7))
    assert (build_on(early, monkeypatch, 0, tp=1, pp=1, dp=2)[0].step,
            build_on(late, monkeypatch, 0, tp=1, pp=1, dp=2)[0].step) == (2, 7)
    assert [t.namespace for t in FakeSource.built] == ["a", "b"]
    with pytest.raises(ConfigError, match=prov.ENV_NAMESPACE):  # the default reads the (empty) environment
        build_on(prov.train_valid_test_datasets_provider, monkeypatch, 0, tp=1, pp=1, dp=2)


def test_iterator_yields_step_microbatch_order_in_megatron_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = configure(ProviderConfig(namespace="ns", num_microbatches=3, start_step=5))
    train, _, _ = build_on(provider, monkeypatch, 2, tp=2, pp=1, dp=2)
    got = [next(train) for _ in range(7)]
    assert [tuple(b["tokens"][0].tolist()) for b in got] == [
        (5, 0, 2), (5, 1, 2), (5, 2, 2), (6, 0, 2), (6, 1, 2), (6, 2, 2), (7, 0, 2)]
    assert got[0]["cu_seqlens"].shape == (1, 2)  # collated like Megatron's DataLoader (micro-batch 1)


def test_state_is_the_clients_data_position_and_resumes_exactly() -> None:
    def make() -> MicrobatchIterator:
        return MicrobatchIterator(client(num_microbatches=4))

    check_save_load(make, lambda it, _i: next(it)["tokens"][0, :2], steps=11, resume_at=[0, 6, 8])
    it = make()
    for _ in range(6):
        next(it)
    state = it.save_state()  # the name Megatron's --dataloader-save convention uses
    assert (state["kind"], state["step"], state["microbatch"]) == ("data_position", 1, 2)
    assert state == it.client.state_dict()
    resumed = make()
    resumed.restore_state(state)
    assert (resumed.step, resumed.microbatch) == (1, 2)


def test_load_state_dict_refuses_incompatible_states() -> None:
    it = MicrobatchIterator(client(num_microbatches=4))
    good = it.state_dict()
    with pytest.raises(ResumeError, match="`num_microbatches` changed: saved 8, now 4"):
        it.load_state_dict({**good, "fingerprint": {"num_microbatches": 8}})
    with pytest.raises(ResumeError, match="version 99"):
        it.load_state_dict({**good, "version": 99})
    with pytest.raises(ResumeError, match="fields missing"):
        it.load_state_dict({k: v for k, v in good.items() if k != "microbatch"})
    with pytest.raises(ResumeError, match="out of range"):
        it.load_state_dict({**good, "microbatch": 4})
    with pytest.raises(ConfigError, match="must not broadcast"):
        MicrobatchIterator(Client(client().topology, 0, source=None, num_microbatches=2))


def test_environment_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prov.ENV_NAMESPACE, "job7")
    monkeypatch.setenv(prov.ENV_RAY_ADDRESS, "10.0.0.1:6379")
    monkeypatch.setenv(prov.ENV_NUM_MICROBATCHES, "2")
    assert ProviderConfig.from_env() == ProviderConfig(namespace="job7", address="10.0.0.1:6379", num_microbatches=2,
                                                       start_step=None)
    seen: list[ProviderConfig] = []

    def factory(topology: ServiceTopology, config: ProviderConfig) -> FakeSource:
        seen.append(config)
        return FakeSource(topology, config)

    provider = prov.configure(None, source_factory=factory, topology_factory=own_topology)  # reads os.environ
    train, _, _ = build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=2)
    assert seen[0].namespace == "job7" and [next(train)["tokens"][0, 1].item() for _ in range(3)] == [0, 1, 0]
    with pytest.raises(ConfigError) as err:
        ProviderConfig.from_env({prov.ENV_NUM_MICROBATCHES: "zero", prov.ENV_START_STEP: "-1"})
    msg = str(err.value)  # every problem at once
    assert prov.ENV_NAMESPACE in msg and "'zero'" in msg and prov.ENV_START_STEP in msg


def test_a_validation_service_becomes_megatrons_valid_iterator_at_megatrons_position(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prov.ENV_NAMESPACE, "job7")
    monkeypatch.setenv(prov.ENV_VALID_NAMESPACE, "job7-valid")
    monkeypatch.setenv(prov.ENV_NUM_MICROBATCHES, "2")
    args = types.SimpleNamespace(dataloader_type="external", iteration=10, eval_interval=4, eval_iters=3)
    monkeypatch.setattr(prov, "_megatron_args", lambda: args)  # Megatron-LM's namespace after loading iteration 10
    provider = prov.configure(None, source_factory=FakeSource, topology_factory=own_topology)
    train, valid, test = build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=2)
    assert [t.namespace for t in FakeSource.built] == ["job7", "job7-valid"] and test is None
    assert (train.step, valid.step) == (10, 6)  # two evaluations (after 4 and 8) of 3 steps each came before
    assert [tuple(next(valid)["tokens"][0, :2].tolist()) for _ in range(3)] == [(6, 0), (6, 1), (7, 0)]
    assert (train.step, train.microbatch) == (10, 0)  # evaluating never moves the training stream
    monkeypatch.delenv(prov.ENV_VALID_NAMESPACE)
    unvalidated = prov.configure(None, source_factory=FakeSource, topology_factory=own_topology)
    assert build_on(unvalidated, monkeypatch, 0, tp=1, pp=1, dp=2)[1] is None


def test_configure_from_service_handles() -> None:
    from megascale_data_ext.runtime.handles import ServiceHandles

    topo = own_topology(ClientPlaceTree.from_sizes(dp=2), ProviderConfig(namespace="svc"))
    handles = ServiceHandles(address="auto", topology=topo)
    cfg = prov.configure(handles, num_microbatches=5, start_step=9).config
    assert cfg == ProviderConfig(namespace="svc", address="auto", num_microbatches=5, start_step=9, topology=topo)
    with pytest.raises(ConfigError, match="got int"):
        prov.configure(3)


def test_a_service_planned_for_another_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    other = own_topology(ClientPlaceTree.from_sizes(dp=4), ProviderConfig(namespace="svc"))
    provider = prov.configure(ProviderConfig(namespace="svc", num_microbatches=2, topology=other),
                              source_factory=FakeSource)
    with pytest.raises(ConfigError, match="start the service with this job's parallel layout"):
        build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=2)


def test_provider_refuses_unknown_microbatches(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = configure(ProviderConfig(namespace="ns"))
    with pytest.raises(ConfigError, match=prov.ENV_NUM_MICROBATCHES):
        build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=2)
    ps = fake_parallel_state(0, tp=1, pp=1, dp=2)
    ps.model_parallel_is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    with pytest.raises(ParallelLayoutError, match="not initialised"):
        provider([1, 0, 0])


def _cp_batches_pass_through_018(monkeypatch: pytest.MonkeyPatch, mutils: Any, names: tuple[str, str]) -> None:
    """megatron-core >= 0.18: pretrain_gpt calls `get_batch_on_this_cp_rank`, which dispatches to a
    packed and an unpacked slicer (`names`, renamed in 0.19): both pass through."""
    import torch

    current = lambda: tuple(getattr(mutils, name) for name in names)  # noqa: E731
    originals = current()
    provider = configure(ProviderConfig(namespace="ns", num_microbatches=2))
    try:
        build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=2, cp=2)
        assert all(now is not was for now, was in zip(current(), originals, strict=True))
        tokens = torch.arange(6)[None]
        packed = {"tokens": tokens, "cu_seqlens": torch.tensor([[0, 4, 6]]), "cu_seqlens_padded": None}
        assert mutils.get_batch_on_this_cp_rank(packed, False, cp_group=object())["tokens"] is tokens
        assert mutils.get_batch_on_this_cp_rank({"tokens": tokens}, False, cp_group=object())["tokens"] is tokens
    finally:
        prov.reset()
    assert current() == originals


def test_cp_batches_arrive_sliced_and_megatron_does_not_slice_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CP > 1 the service slices; Megatron's CP slicing (as pretrain_gpt imports it) becomes a pass-through
    that still builds megatron-core's THD PackedSeqParams."""
    import types

    import torch
    from megatron.core import utils as mutils

    from megascale_data_ext.dataplane.cp_slicing import slice_for_cp
    from megascale_data_ext.dataplane.packing import pack_microbatch

    for names in (("get_sft_batch_on_this_cp_rank", "get_pretrain_batch_on_this_cp_rank"),  # megatron-core 0.18
                  ("_get_batch_on_this_cp_rank_per_document_balancing",  # 0.19
                   "_get_batch_on_this_cp_rank_per_sequence_balancing")):
        if all(hasattr(mutils, name) for name in names):
            _cp_batches_pass_through_018(monkeypatch, mutils, names)
            return
    # pretrain_gpt.py does `from megatron.core.utils import get_thd_batch_on_this_cp_rank`
    pretrain_gpt = types.ModuleType("fake_pretrain_gpt")
    pretrain_gpt.get_thd_batch_on_this_cp_rank = mutils.get_thd_batch_on_this_cp_rank
    monkeypatch.setitem(sys.modules, "fake_pretrain_gpt", pretrain_gpt)
    original = mutils.get_thd_batch_on_this_cp_rank
    provider = configure(ProviderConfig(namespace="ns", num_microbatches=2))
    try:
        train, _, _ = build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=2, cp=2)
        assert isinstance(train, prov.MicrobatchIterator)
        assert pretrain_gpt.get_thd_batch_on_this_cp_rank is not original
        pack = pack_microbatch([{"tokens": np.arange(3, 8)}, {"tokens": np.arange(20, 23)}], seq_length=8, pad_id=0)
        piece = {k: torch.from_numpy(np.asarray(v)) for k, v in slice_for_cp(pack, cp_size=2, cp_rank=1).items()}
        view = prov.megatron_view(piece)
        assert "cu_seqlens_padded" not in view and view["cu_seqlens"].tolist() == [[0, 8, 12]]
        fields = {k: view[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
        out, params = pretrain_gpt.get_thd_batch_on_this_cp_rank(fields, view["cu_seqlens"][0], None,
                                                                 view["max_seqlen"])
        assert out["tokens"].tolist() == [[5, 6, 7, 7, 21, 22]]  # untouched: already this rank's slice
        assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 8, 12] and params.max_seqlen_q == 8
    finally:
        prov.reset()
    assert pretrain_gpt.get_thd_batch_on_this_cp_rank is original and mutils.get_thd_batch_on_this_cp_rank is original


def test_interleaved_pipeline_only_first_and_last_virtual_chunk_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = configure(ProviderConfig(namespace="ns", num_microbatches=2), valid_factory=lambda vp: f"valid{vp}")
    layout = dict(tp=1, pp=2, dp=1, vpp=2)
    fetch = {(rank, vp): build_on(provider, monkeypatch, rank, vp, **layout)[0].fetches
             for rank in (0, 1) for vp in (0, 1)}
    assert fetch == {(0, 0): True, (0, 1): False, (1, 0): False, (1, 1): True}
    assert build_on(provider, monkeypatch, 0, 1, **layout)[1] == "valid1"


def test_megatron_view_fills_fields_another_stage_owns() -> None:
    last_stage = {"labels": torch.ones(1, 4, dtype=torch.int64), "loss_mask": torch.ones(1, 4),
                  "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}
    view = megatron_view(last_stage)
    assert view["tokens"].shape == (1, 4) and view["tokens"].dtype == torch.int64
    assert view["position_ids"].sum().item() == 0 and view["cu_seqlens"].shape == (1, 2)
    assert view["labels"] is last_stage["labels"]


def test_megatrons_rerun_wrapper_drives_the_iterator() -> None:
    """Megatron wraps an external loader in RerunDataIterator and calls next() on it."""
    rsm = pytest.importorskip("megatron.core.rerun_state_machine")
    wrapped = rsm.RerunDataIterator(MicrobatchIterator(client(rank=1, num_microbatches=2)))
    assert [next(wrapped)["tokens"][0].tolist() for _ in range(3)] == [[0, 0, 1], [0, 1, 1], [1, 0, 1]]
    assert wrapped.iterable.state_dict()["step"] == 1


def test_a_service_broadcasting_other_than_over_tp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-LM's get_batch broadcasts over TP itself: the service must fetch at TP rank 0 only."""
    tp_wide = own_topology(ClientPlaceTree.from_sizes(tp=2, dp=2), ProviderConfig(namespace="s"))
    everyone = dataclasses.replace(tp_wide, distribution=tp_wide.distribution.with_broadcast(()))
    provider = prov.configure(ProviderConfig(namespace="s", num_microbatches=2, topology=everyone),
                              source_factory=FakeSource)
    with pytest.raises(ConfigError, match=r"broadcasts along \[\], but Megatron-LM's get_batch broadcasts over TP"):
        build_on(provider, monkeypatch, 0, tp=2, pp=1, dp=2)


def test_delivery_log_records_each_delivered_microbatch_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """MEGASCALE_DELIVERY_LOG: one JSON line per microbatch a fetching rank delivered, with its samples."""
    import json

    class WithSamples(FakeSource):
        def get(self, step: int, microbatch: int, rank: int):
            batch, info = super().get(step, microbatch, rank)
            return batch, {**info, "samples": np.asarray([[0, 10 * step + microbatch, 7]], np.int64), "tokens": 3}

    log = tmp_path / "delivered.jsonl"
    monkeypatch.setenv(prov.ENV_DELIVERY_LOG, str(log))
    provider = prov.configure(ProviderConfig(namespace="ns", num_microbatches=2, start_step=1),
                              source_factory=WithSamples, topology_factory=own_topology)
    train, _, _ = build_on(provider, monkeypatch, 0, tp=2, pp=1, dp=1)
    idle, _, _ = build_on(provider, monkeypatch, 1, tp=2, pp=1, dp=1)  # TP rank 1: yields None, logs nothing
    for _ in range(3):
        next(train), next(idle)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["rank"], r["step"], r["microbatch"]) for r in lines] == [(0, 1, 0), (0, 1, 1), (0, 2, 0)]
    assert [r["samples"] for r in lines] == [[[0, 10, 7]], [[0, 11, 7]], [[0, 20, 7]]] and lines[0]["tokens"] == 3
    monkeypatch.delenv(prov.ENV_DELIVERY_LOG)
    assert build_on(provider, monkeypatch, 0, tp=2, pp=1, dp=1)[0].delivery_log is None  # off by default


def test_packed_seq_off_yields_no_document_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """MEGASCALE_PACKED_SEQ=0 (--transformer-impl local): get_batch then builds no PackedSeqParams."""
    provider = configure(ProviderConfig(namespace="ns", num_microbatches=2))
    assert "cu_seqlens" in next(build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=1)[0])
    monkeypatch.setenv(prov.ENV_PACKED_SEQ, "0")
    batch = next(build_on(provider, monkeypatch, 0, tp=1, pp=1, dp=1)[0])
    assert "cu_seqlens" not in batch and "max_seqlen" not in batch and batch["tokens"].shape == (1, 3)
