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


def test_balanced_service_runs_token_budget_steps_vanilla_one_document_per_microbatch(blend):
    vanilla = bt.service_config(blend, strategy="vanilla", seq_length=256, seed=1, attention_mask=False, dp=2)
    assert vanilla.tokens_per_step is None and vanilla.samples_per_step == 2 * bt.NUM_MICROBATCHES
    assert all(s.truncate and s.max_tokens == 256 for s in vanilla.sources)
    tok = bt.service_config(blend, strategy="llm_balance", seq_length=256, seed=1, attention_mask=False, dp=8)
    assert tok.tokens_per_step == 8 * bt.NUM_MICROBATCHES * 256 and tok.split_documents
    assert all(s.max_tokens is None for s in tok.sources)  # long documents are split, not truncated


def test_table_reports_ratios_against_megatron():
    def result(name: str, tokens: int, cpu: float, rss: list[float]) -> bt.LoaderResult:
        return bt.LoaderResult(name=name, batches=10, tokens=tokens, first_batch_s=1.0, steady_s=2.0,
                               fetch_ms=[1.0] * 10, cpu_loader_s=cpu, cpu_all_s=cpu, cpu_loader_total_s=cpu,
                               step_wait_ms=[4.0, 8.0], rss_mib=rss)

    table = bt.format_table([result("megatron", 1000, 1.0, [100.0]), result("service x", 3000, 2.0, [80.0, 70.0])])
    rows = {line.split("  ")[0].strip(): line.split() for line in table.splitlines()}
    assert rows["tokens/s (wall)"][-1] == "3.00x"
    assert rows["tokens per loader CPU-s"][-1] == "1.50x"
    assert rows["actor RSS (MiB)"][-1] == "1.50x"  # summed over the loading processes
    assert rows["trainer wait per step (ms)"][-3:] == ["6", "6", "1.00x"]  # mean over (rank, step)


def test_bad_arguments_are_named():
    args = argparse.Namespace(quick=False, sources=0, docs=10, seq_length=128, steps=1, strategies="vlm_balance",
                              seed=0, attention_mask=False, workdir=None, json=None, dp=0, large=False)
    with pytest.raises(ConfigError) as exc:
        bt.run(args)
    assert "--sources" in str(exc.value) and "--dp" in str(exc.value) and "vlm_balance" in str(exc.value)


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
    # token-budget steps with split documents fill every microbatch, as Megatron's windows do
    assert svc["tokens"] == fetches * L and svc["tokens_per_step"] == bt.DP * bt.NUM_MICROBATCHES * L
    keys = {"tokens per loader CPU-s", "tokens/s (wall)", "time to first batch (s)", "tokens/microbatch",
            "fetch p50 (ms)", "fetch p99 (ms)", "actor RSS (MiB)", "trainer wait per step (ms)"}
    assert keys <= set(svc["metrics"]) and keys <= set(meg["metrics"])
    assert 0 < svc["metrics"]["actor RSS (MiB)"] and len(svc["rss_mib"]) == 2 + 1 + 1  # loaders, planner, constructor
    assert svc["actors_importing_torch"] == 0  # lightweight actors: numpy + pyarrow only
