"""Hybrid CP through the service (issue 26): the Planner plans each document its own group of
DP x CP consumers, the constructors pack and slice each microbatch for its group, every consumer
gets its own number of microbatches, and every sample reaches training exactly once."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from megascale_data_ext.dataplane.cp_slicing import reassemble_cp
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.sources.demo_data import make_demo_data

SEQ = 512  # the longest sequence; at CP 2 a consumer holds CAP tokens a microbatch
CAP = SEQ // 2


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    specs = make_demo_data(tmp_path_factory.mktemp("demo"), seed=5, rows=150, text_sources=2, image_sources=0,
                           megatron_rows=100)
    specs = [dataclasses.replace(s, truncate=True) for s in specs]
    tree = ClientPlaceTree.from_sizes(dp=2, cp=2)
    cfg = ServiceConfig(sources=specs, seed=7, samples_per_step=24, num_microbatches=2, seq_length=SEQ,
                        strategy="hybrid_cp", strategy_args={"model": "gpt-tiny"}, buffer_size=64)
    return InProcessService(cfg, tree), tree


def test_each_consumer_gets_its_groups_slices_and_every_sample_once(service) -> None:
    svc, tree = service
    assert svc.topology.variable_counts and svc.topology.layout.num_buckets == 4
    seen, counts, split = [], set(), 0
    for step in range(6):
        per_rank = {rank: svc.constructor_of(rank).get_step(step, rank) for rank in range(4)}
        counts.add(tuple(len(mbs) for mbs in per_rank.values()))
        groups: dict[tuple, list] = {}
        for rank, mbs in per_rank.items():
            bucket = svc.topology.layout.bucket_of_rank(rank)
            assert bucket == tree.coords(rank)["dp"] * 2 + tree.coords(rank)["cp"]  # megatron's DP x CP order
            for j, (batch, info) in enumerate(mbs):
                size, place = info["local_cp_size"], info["rank_in_group"]
                assert int(batch["local_cp_size"]) == size and info["microbatch"] == j
                assert info["microbatches"] == len(mbs)
                assert batch["tokens"].shape[1] <= CAP + 2 * len(info["samples"])  # the cap, and THD padding
                if place == 0:
                    seen += [tuple(k) for k in info["samples"].tolist()]
                key = tuple(map(tuple, info["samples"].tolist()))
                groups.setdefault(key, []).append((bucket - place, size, place, batch))
        for parts in groups.values():  # every member of a group: the same documents, its own slice
            first, size = parts[0][0], parts[0][1]
            assert sorted(p[2] for p in parts) == list(range(size)) and all(p[0] == first for p in parts)
            if size > 1:
                split += 1
                whole = reassemble_cp([{k: v for k, v in p[3].items() if k != "local_cp_size"}
                                       for p in sorted(parts, key=lambda p: p[2])], size)
                assert int(whole["loss_mask"].sum()) == sum(int(p[3]["loss_mask"].sum()) for p in parts)
    assert len(seen) == len(set(seen)) == 6 * 24  # every sample once, none twice
    for s in {k[0] for k in seen}:
        assert sorted(p for src, p, _ in seen if src == s) == list(range(sum(1 for k in seen if k[0] == s)))
    assert split > 0  # documents over CAP tokens ran on groups of 2 or 4
    assert any(len(set(c)) > 1 for c in counts)  # consumers ran different numbers of microbatches


def test_hybrid_cp_is_refused_by_key_where_it_cannot_run(tmp_path) -> None:
    from megascale_data_ext.config import compose_config, load_config
    from megascale_data_ext.errors import ConfigError
    from megascale_data_ext.trainer.pretrain import gpt_model_config

    base = ["strategy=hybrid_cp", f"data.data_root={tmp_path}", "sources=demo_text"]
    make_demo_data(tmp_path, seed=1, rows=20, text_sources=3, image_sources=0, megatron_rows=20, validation_rows=10)
    cfg = compose_config(base + ["data.tokens_per_step=8192"])
    with pytest.raises(ConfigError, match=r"`data.tokens_per_step`: strategy hybrid_cp plans a count of samples"):
        load_config(cfg.data)
    cfg = compose_config(base + ["parallel.pipeline_model_parallel_size=2"])
    service = SimpleNamespace(strategy="hybrid_cp", seq_length=512)  # what gpt_model_config reads of it
    with pytest.raises(ConfigError) as err:
        gpt_model_config(cfg, service, 128)
    assert "data.strategy=hybrid_cp needs train.per_token_loss=true" in str(err.value)
    ok = compose_config(base + ["train.per_token_loss=true", "parallel.pipeline_model_parallel_size=2"])
    assert gpt_model_config(ok, service, 128).hybrid_cp
    vpp = compose_config(base + ["train.per_token_loss=true", "parallel.pipeline_model_parallel_size=2",
                                 "parallel.virtual_pipeline_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"parallel.virtual_pipeline_model_parallel_size=null"):
        gpt_model_config(vpp, service, 128)
    pp4 = compose_config(base + ["train.per_token_loss=true", "parallel.pipeline_model_parallel_size=4"])
    no_masks = SimpleNamespace(strategy="hybrid_cp", seq_length=512, middle_stage_masks=False)
    with pytest.raises(ConfigError, match=r"data.middle_stage_masks=true"):
        gpt_model_config(pp4, no_masks, 128)
    assert gpt_model_config(pp4, service, 128).hybrid_cp  # with the masks (the default) it runs


def test_under_pp2_a_group_sits_at_one_index_on_its_consumers_and_holes_are_fillers(tmp_path, monkeypatch) -> None:
    """With PP 2 the plan is aligned (`HybridPlan.slots`). The planner's own order needs no filler,
    so the plan is shuffled here (as another planner could order it) to make holes: every
    consumer's list then has the group at one index, and a filler (padding, no token) elsewhere."""
    from megascale_data_ext.dataplane import dgraph
    from megascale_data_ext.dataplane.balancers.hybrid_cp import balance_hybrid_cp

    def shuffled(*args, **kwargs):
        plan = balance_hybrid_cp(*args, **kwargs)
        plan.microbatches = [plan.microbatches[i] for i in np.random.default_rng(3).permutation(len(plan.microbatches))]
        return plan

    monkeypatch.setattr(dgraph, "balance_hybrid_cp", shuffled)
    specs = make_demo_data(tmp_path, seed=5, rows=150, text_sources=2, image_sources=0, megatron_rows=100)
    tree = ClientPlaceTree.from_sizes(dp=2, cp=2, pp=2)
    cfg = ServiceConfig(sources=[dataclasses.replace(s, truncate=True) for s in specs], seed=7, samples_per_step=24,
                        num_microbatches=2, seq_length=SEQ, strategy="hybrid_cp", strategy_args={"model": "gpt-tiny"},
                        buffer_size=64)
    svc = InProcessService(cfg, tree)
    seen, fillers = [], 0
    for step in range(4):
        at: dict[tuple, set] = {}
        for rank in range(8):
            stage = tree.coords(rank)["pp"]
            for j, (batch, info) in enumerate(svc.constructor_of(rank).get_step(step, rank)):
                assert int(batch["local_cp_size"]) == info["local_cp_size"]  # every stage runs it on its group
                if len(info["samples"]) == 0:
                    fillers += 1
                    assert info["local_cp_size"] == 1 and info["tokens"] == 0
                    field = next(v for k, v in batch.items() if k in ("tokens", "labels", "loss_mask"))
                    assert field.shape[1] <= 2 * cfg.pad_to_multiple_of  # the shortest pack
                    continue
                at.setdefault(tuple(map(tuple, info["samples"].tolist())), set()).add((stage, j))
                if stage == 0 and info["rank_in_group"] == 0:
                    seen += [tuple(k) for k in info["samples"].tolist()]
        assert all(len({j for _, j in where}) == 1 for where in at.values())  # one index on all members, both stages
    assert fillers > 0
    assert len(seen) == len(set(seen)) == 4 * 24
