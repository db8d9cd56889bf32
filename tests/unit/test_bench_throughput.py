"""`bench throughput`: the blend, Megatron's sampler semantics, exact token accounting, CLI smoke."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from megascale_data_ext.commands import bench_throughput as bt
from megascale_data_ext.errors import ConfigError


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> list[str]:
    return bt.write_blend(tmp_path_factory.mktemp("blend"), sources=2, docs=120, seq_length=256, seed=7)


def test_blend_is_seeded_long_short_and_eod_terminated(blend, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    again = bt.write_blend(tmp_path, sources=2, docs=120, seq_length=256, seed=7)
    for a, b in zip(blend, again, strict=True):
        assert Path(a + ".bin").read_bytes() == Path(b + ".bin").read_bytes()  # same seed, same bytes
    ds = IndexedDataset(blend[0])
    assert len(ds) == 120
    docs = [np.asarray(ds[i]) for i in range(len(ds))]
    assert all(d[-1] == bt.EOD_ID and (d[:-1] >= bt.TOKEN_OFFSET).all() for d in docs)
    lengths = np.array([len(d) for d in docs])
    assert lengths.max() > 256 > np.median(lengths)  # a few documents longer than the context


def test_sampler_matches_megatron_pretraining_sampler():
    # Megatron-LM's MegatronPretrainingSampler: rank r takes [r*mbs, (r+1)*mbs) of each mbs*dp chunk.
    s = bt.MegatronPretrainingSampler(total_samples=21, consumed_samples=4, micro_batch_size=2,
                                      data_parallel_rank=1, data_parallel_size=2)
    assert list(s) == [[6, 7], [10, 11], [14, 15], [18, 19]]
    assert len(s) == 4
    whole = bt.MegatronPretrainingSampler(total_samples=5, consumed_samples=0, micro_batch_size=1,
                                          data_parallel_rank=0, data_parallel_size=1)
    assert [b for batch in whole for b in batch] == [0, 1, 2, 3, 4]


def test_vanilla_gets_one_document_per_microbatch_balanced_fills_capacity(blend):
    assert bt.service_samples_per_step(blend, seq_length=256, strategy="vanilla") == bt.DP * bt.NUM_MICROBATCHES
    n = bt.service_samples_per_step(blend, seq_length=1024, strategy="llm_balance")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    datasets = [IndexedDataset(p) for p in blend]  # alive while their mmap'd lengths are read
    mean = np.mean(np.concatenate([np.minimum(ds.sequence_lengths, 1024) for ds in datasets]))
    assert n == int(bt.FILL * bt.DP * bt.NUM_MICROBATCHES * 1024 / mean) > bt.DP * bt.NUM_MICROBATCHES


def test_table_reports_ratios_against_megatron():
    def result(name: str, tokens: int, cpu: float) -> bt.LoaderResult:
        return bt.LoaderResult(name=name, batches=10, tokens=tokens, first_batch_s=1.0, steady_s=2.0,
                               fetch_ms=[1.0] * 10, cpu_loader_s=cpu, cpu_all_s=cpu, cpu_loader_total_s=cpu)

    table = bt.format_table([result("megatron", 1000, 1.0), result("service x", 3000, 2.0)])
    rows = {line.split("  ")[0].strip(): line.split() for line in table.splitlines()}
    assert rows["tokens/s (wall)"][-1] == "3.00x"
    assert rows["tokens per loader CPU-s"][-1] == "1.50x"


def test_bad_arguments_are_named():
    args = argparse.Namespace(quick=False, sources=0, docs=10, seq_length=128, steps=1, strategies="vlm_balance",
                              seed=0, attention_mask=False, workdir=None, json=None)
    with pytest.raises(ConfigError) as exc:
        bt.run(args)
    assert "--sources" in str(exc.value) and "vlm_balance" in str(exc.value)


@pytest.mark.slow
def test_megatron_path_delivers_full_windows(blend, tmp_path):
    """Megatron's GPTDataset windows are all real tokens: exactly (batches - 1) × L after the first."""
    r = bt.run_megatron(blend, seq_length=256, batches=12, seed=1, cache=tmp_path / "cache", attention_mask=False)
    assert r.batches == 11 and r.tokens == 11 * 256 and len(r.fetch_ms) == 11
    assert r.first_batch_s > 0 and r.cpu_loader_s >= 0
    assert list((tmp_path / "cache").rglob("*.npy"))  # the index really was built and cached


@pytest.mark.slow
def test_quick_cli_smoke(tmp_path, capsys):
    from megascale_data_ext.cli import main

    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--quick", "--json", str(out), "--workdir", str(tmp_path / "w")]) == 0
    table = capsys.readouterr().out
    assert "megatron" in table and "service llm_balance / megatron" in table
    got = json.loads(out.read_text())
    meg, svc = got["results"]
    steps, L = got["args"]["steps"], got["args"]["seq_length"]
    fetches = steps * bt.DP * bt.NUM_MICROBATCHES - 1  # the first batch is timed separately
    assert meg["batches"] == svc["batches"] == fetches
    assert meg["tokens"] == fetches * L
    assert 0 < svc["tokens"] <= fetches * L
