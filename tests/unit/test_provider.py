"""The `--dataloader-type external` provider over a mocked `parallel_state` and a fake service client."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from megascale_data_ext.errors import ConfigError, ParallelLayoutError, ResumeError
from megascale_data_ext.megatron import provider as prov
from megascale_data_ext.megatron.provider import MicrobatchIterator, ProviderConfig, megatron_view

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

    built: list[tuple[int, int]] = []  # (rank, num_microbatches) of every source built

    def __init__(self, tree: Any, rank: int, config: ProviderConfig, num_microbatches: int) -> None:
        self.rank = rank
        FakeSource.built.append((rank, num_microbatches))

    def fetch(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        t = torch.tensor([[step, microbatch, self.rank]], dtype=torch.int64)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(1, 3), "position_ids": torch.arange(3)[None],
                "cu_seqlens": torch.tensor([0, 3], dtype=torch.int32)}


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    FakeSource.built = []
    for var in (prov.ENV_NAMESPACE, prov.ENV_RAY_ADDRESS, prov.ENV_NUM_MICROBATCHES, prov.ENV_START_STEP,
                prov.ENV_CONSTRUCTOR_GROUP):
        monkeypatch.delenv(var, raising=False)
    prov.reset()
    yield
    prov.reset()


def build_on(monkeypatch: pytest.MonkeyPatch, rank: int, vp_stage: int | None = None, **layout: Any):
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake_parallel_state(rank, **layout))
    return prov.train_valid_test_datasets_provider([100, 10, 10], vp_stage=vp_stage)


def test_provider_is_distributed_and_only_fetching_ranks_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prov.train_valid_test_datasets_provider.is_distributed is True
    prov.configure(ProviderConfig(namespace="ns", num_microbatches=3, start_step=5), client_factory=FakeSource)
    fetching = []
    for rank in range(8):  # tp=2, pp=2, dp=2: ranks 0..3 stage 0, 4..7 stage 1; tp rank = rank % 2
        train, valid, test = build_on(monkeypatch, rank, tp=2, pp=2, dp=2)
        assert isinstance(train, MicrobatchIterator) and valid is None and test is None
        assert (train.step, train.microbatch) == (5, 0)
        if train.fetches:
            fetching.append(rank)
        else:
            assert [next(train) for _ in range(4)] == [None] * 4
            assert (train.step, train.microbatch) == (6, 1)  # non-fetchers still count
    # Exactly the ranks on which Megatron's get_batch calls next(): TP rank 0 of first and last stage.
    assert fetching == [0, 2, 4, 6]
    assert FakeSource.built == [(r, 3) for r in fetching]


def test_iterator_yields_step_microbatch_order_in_megatron_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    prov.configure(ProviderConfig(namespace="ns", num_microbatches=3, start_step=5), client_factory=FakeSource)
    train, _, _ = build_on(monkeypatch, 2, tp=2, pp=1, dp=2)
    got = [next(train) for _ in range(7)]
    assert [tuple(b["tokens"][0].tolist()) for b in got] == [
        (5, 0, 2), (5, 1, 2), (5, 2, 2), (6, 0, 2), (6, 1, 2), (6, 2, 2), (7, 0, 2)]
    assert got[0]["cu_seqlens"].shape == (1, 2)  # collated like Megatron's DataLoader (micro-batch 1)


def test_state_dict_round_trip_matches_uninterrupted_run() -> None:
    src = FakeSource(None, 0, ProviderConfig(namespace="ns"), 4)
    whole = MicrobatchIterator(src, num_microbatches=4, start_step=2)
    reference = [next(whole)["tokens"][0, :2].tolist() for _ in range(11)]
    first = MicrobatchIterator(src, num_microbatches=4, start_step=2)
    for _ in range(6):
        next(first)
    state = first.state_dict()
    assert state == {"version": prov.STATE_VERSION, "step": 3, "microbatch": 2, "num_microbatches": 4}
    resumed = MicrobatchIterator(src, num_microbatches=4)
    resumed.restore_state(state)  # the name Megatron's --dataloader-save convention uses
    assert [next(resumed)["tokens"][0, :2].tolist() for _ in range(5)] == reference[6:]
    assert resumed.save_state() == whole.state_dict()


def test_load_state_dict_refuses_incompatible_states() -> None:
    it = MicrobatchIterator(None, num_microbatches=4)
    with pytest.raises(ResumeError, match="num_microbatches changed: saved 8 != current 4"):
        it.load_state_dict({"version": 1, "step": 3, "microbatch": 0, "num_microbatches": 8})
    with pytest.raises(ResumeError, match="version 99"):
        it.load_state_dict({"version": 99, "step": 3, "microbatch": 0, "num_microbatches": 4})
    with pytest.raises(ResumeError, match="lacks"):
        it.load_state_dict({"step": 3})
    with pytest.raises(ResumeError, match="out of range"):
        it.load_state_dict({"version": 1, "step": 3, "microbatch": 4, "num_microbatches": 4})


def test_environment_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prov.ENV_NAMESPACE, "job7")
    monkeypatch.setenv(prov.ENV_RAY_ADDRESS, "10.0.0.1:6379")
    monkeypatch.setenv(prov.ENV_NUM_MICROBATCHES, "2")
    monkeypatch.setenv(prov.ENV_CONSTRUCTOR_GROUP, "4")
    assert ProviderConfig.from_env() == ProviderConfig(namespace="job7", address="10.0.0.1:6379", num_microbatches=2,
                                                       constructor_group=4, start_step=None)
    seen: list[ProviderConfig] = []

    def factory(tree: Any, rank: int, config: ProviderConfig, n: int) -> FakeSource:
        seen.append(config)
        return FakeSource(tree, rank, config, n)

    prov.configure(None, client_factory=factory)  # reads os.environ
    train, _, _ = build_on(monkeypatch, 0, tp=1, pp=1, dp=2)
    assert seen[0].namespace == "job7" and [next(train)["tokens"][0, 1].item() for _ in range(3)] == [0, 1, 0]
    with pytest.raises(ConfigError) as err:
        ProviderConfig.from_env({prov.ENV_NUM_MICROBATCHES: "zero", prov.ENV_START_STEP: "-1"})
    msg = str(err.value)  # every problem at once
    assert prov.ENV_NAMESPACE in msg and "'zero'" in msg and prov.ENV_START_STEP in msg


def test_configure_from_service_handles() -> None:
    from megascale_data_ext.runtime.service import ServiceHandles

    handles = ServiceHandles(address="auto", namespace="svc", num_constructors=2, constructor_group=2)
    cfg = prov.configure(handles, num_microbatches=5, start_step=9)
    assert cfg == ProviderConfig(namespace="svc", address="auto", num_microbatches=5, constructor_group=2,
                                 start_step=9)
    with pytest.raises(ConfigError, match="got int"):
        prov.configure(3)


def test_provider_refuses_cp_and_unknown_microbatches(monkeypatch: pytest.MonkeyPatch) -> None:
    prov.configure(ProviderConfig(namespace="ns", num_microbatches=2), client_factory=FakeSource)
    with pytest.raises(ConfigError, match="context parallel size 2"):
        build_on(monkeypatch, 0, tp=1, pp=1, dp=2, cp=2)
    prov.configure(ProviderConfig(namespace="ns"), client_factory=FakeSource)
    with pytest.raises(ConfigError, match=prov.ENV_NUM_MICROBATCHES):
        build_on(monkeypatch, 0, tp=1, pp=1, dp=2)
    ps = fake_parallel_state(0, tp=1, pp=1, dp=2)
    ps.model_parallel_is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    with pytest.raises(ParallelLayoutError, match="not initialised"):
        prov.train_valid_test_datasets_provider([1, 0, 0])


def test_interleaved_pipeline_only_first_and_last_virtual_chunk_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    prov.configure(ProviderConfig(namespace="ns", num_microbatches=2), client_factory=FakeSource,
                   valid_factory=lambda vp: f"valid{vp}")
    layout = dict(tp=1, pp=2, dp=1, vpp=2)
    fetch = {(rank, vp): build_on(monkeypatch, rank, vp, **layout)[0].fetches for rank in (0, 1) for vp in (0, 1)}
    assert fetch == {(0, 0): True, (0, 1): False, (1, 0): False, (1, 1): True}
    assert build_on(monkeypatch, 0, 1, **layout)[1] == "valid1"


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
    src = FakeSource(None, 1, ProviderConfig(namespace="ns"), 2)
    wrapped = rsm.RerunDataIterator(MicrobatchIterator(src, num_microbatches=2, start_step=0))
    assert [next(wrapped)["tokens"][0].tolist() for _ in range(3)] == [[0, 0, 1], [0, 1, 1], [1, 0, 1]]
    assert wrapped.iterable.state_dict()["step"] == 1
