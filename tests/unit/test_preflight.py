"""Start-up checks before heavy imports (megascale_data_ext/megatron/preflight.py): every layout
problem at once with the config keys named, the data node validated, an unreachable Ray address
bounded in time, and nothing of torch / megatron / ray imported to find out."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from megascale_data_ext.errors import ConfigError, ParallelLayoutError
from megascale_data_ext.megatron.preflight import layout_problems, preflight


def config(tmp_path, *, tp=1, pp=1, cp=1, vpp=None, layers=2, heads=4, hidden=64, address=None, seq_length=128):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(8)))
    return OmegaConf.create({
        "data": {"data_root": str(tmp_path), "seq_length": seq_length, "samples_per_step": 4, "num_microbatches": 1,
                 "sources": [{"name": "a", "format": "jsonl", "paths": ["a.jsonl"], "truncate": True}],
                 "strategy": {"name": "llm_balance"}, "ray": {"address": address}},
        "model": {"num_layers": layers, "num_attention_heads": heads, "hidden_size": hidden},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "context_parallel_size": cp, "virtual_pipeline_model_parallel_size": vpp},
    })


def test_every_layout_problem_is_reported_at_once_with_its_config_key(tmp_path):
    cfg = config(tmp_path, tp=2, pp=2, vpp=2, layers=6, heads=3)
    problems = layout_problems(cfg, world_size=6)
    text = " | ".join(problems)
    assert len(problems) == 4, problems  # hidden 64 is not divisible by 3 heads either
    assert "world size 6 is not divisible by tp*pp*cp = 2*2*1 = 4" in text and "4 or 8" in text
    assert "parallel.tensor_model_parallel_size" in text and "parallel.pipeline_model_parallel_size" in text
    assert "`model.num_layers`=6 does not split evenly over pp*vpp = 4" in text
    assert "`model.num_attention_heads`=3 is not divisible by `parallel.tensor_model_parallel_size`=2" in text
    with pytest.raises(ParallelLayoutError, match="the run cannot start"):
        preflight(cfg, world_size=6, check_ray=False)


def test_a_good_layout_passes_and_bad_values_are_named(tmp_path):
    assert layout_problems(config(tmp_path, tp=2, pp=2, layers=4), world_size=8) == []
    bad = config(tmp_path, tp=0)
    assert layout_problems(bad, 4) == ["`parallel.tensor_model_parallel_size` must be an integer >= 1, got 0"]
    interleaved = config(tmp_path, pp=1, vpp=2)
    assert any("virtual_pipeline_model_parallel_size" in p for p in layout_problems(interleaved, 1))


def test_the_data_node_is_checked_before_training(tmp_path):
    preflight(config(tmp_path), world_size=1, check_ray=False)
    with pytest.raises(ConfigError, match="data.seq_length"):
        preflight(config(tmp_path, seq_length=-5), world_size=1, check_ray=False)
    cfg = config(tmp_path)
    cfg.data.sources[0].paths = ["missing.jsonl"]
    with pytest.raises(ConfigError, match="missing.jsonl"):
        preflight(cfg, world_size=1, check_ray=False)


def test_evaluation_needs_held_out_sources_named_before_training(tmp_path):
    cfg = config(tmp_path)
    cfg.train = {"train_iters": 4, "lr": 1e-3, "eval_interval": 2}
    with pytest.raises(ConfigError, match=r"`train.eval_interval`=2 needs held-out sources.*data.validation.sources"):
        preflight(cfg, world_size=1, check_ray=False)
    (tmp_path / "held.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    cfg.data.validation = {"sources": [{"name": "held", "format": "jsonl", "paths": ["held.jsonl"]}]}
    preflight(cfg, world_size=1, check_ray=False)
    cfg.train.eval_iters = 0
    with pytest.raises(ConfigError, match="train.eval_iters"):
        preflight(cfg, world_size=1, check_ray=False)


def test_an_unreachable_ray_address_fails_within_the_probe_bound(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"`data.ray.address` '127.0.0.1:1'"):
        preflight(config(tmp_path, address="127.0.0.1:1"), world_size=1, ray_probe_seconds=1.0)
    assert time.monotonic() - t0 < 15


def test_preflight_imports_neither_torch_nor_megatron_nor_ray(tmp_path):
    code = (
        "import sys, json\n"
        "from omegaconf import OmegaConf\n"
        "from megascale_data_ext.megatron.preflight import preflight\n"
        f"preflight(OmegaConf.create(json.loads({json.dumps(json.dumps(OmegaConf.to_container(config(tmp_path))))})),"
        " world_size=1, check_ray=False)\n"
        "print(sorted(m for m in ('torch', 'megatron', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
