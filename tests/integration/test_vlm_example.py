"""examples/pretrain_vlm.py under torchrun (4 gloo processes, TP1·PP2·DP2): the hybrid strategy's
encoder share reaches every rank over WORLD, the frozen ViT's features are embedded into the
backbone's first stage, and the loss is finite and falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_data")
    subprocess.run([sys.executable, "-m", "megascale_data_ext", "demo-data", "--out", str(root), "--rows", "200"],
                   check=True, capture_output=True)
    return root


def test_vlm_example_encodes_over_world_and_trains_at_pp2_dp2(data_root, tmp_path):
    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "examples" / "pretrain_vlm.py"), f"data.data_root={data_root}", f"train.log_dir={log_dir}",
           "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2", "train.train_iters=3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3 and all("encoder max/mean vanilla" in ln for ln in lines), proc.stdout[-2000:]
    print("\n".join(lines))
    logs = {int(p.stem[4:]): json.loads(p.read_text()) for p in log_dir.glob("rank*.json")}
    assert sorted(logs) == [0, 1, 2, 3]

    losses = [s["loss"] for s in logs[0]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    for step in range(3):
        head = logs[0][step]
        planned = [tuple(k) for k in head["planned_keys"]]
        assert len(planned) > 0
        for rank in range(4):  # every rank encoded exactly its planned share over WORLD
            mine = Counter(tuple(k) for k in logs[rank][step]["encoded_keys"])
            want = Counter(k for k, r in zip(planned, head["planned_ranks"], strict=True) if r == rank)
            assert mine == want
        assert sum(logs[r][step]["encoded_patches"] for r in range(4)) == sum(head["balance"]["patches_per_rank"])
        # the first-stage ranks (one per DP rank) embedded every planned image patch exactly once
        embedded = sum(logs[r][step]["image_tokens_embedded"] for r in range(4))
        assert embedded == sum(head["balance"]["patches_per_rank"])
        assert head["balance"]["encoder_max_over_mean"] <= head["balance"]["encoder_vanilla_max_over_mean"] + 1e-9
