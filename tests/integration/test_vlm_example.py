"""examples/pretrain_vlm.py under torchrun (4 gloo processes, TP1·PP2·DP2): the hybrid strategy's
encoder share reaches every rank over WORLD, the frozen ViT's features are embedded into the
backbone's first stage, and the loss is finite and falls."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.dist import launch

pytestmark = pytest.mark.slow
PATCH_DIM = 768  # conf/train_vlm.yaml vision.patch_dim (16 x 16 x 3)


def test_vlm_example_encodes_over_world_and_trains_at_pp2_dp2(data_root, tmp_path):
    out, logs = launch.run_example("pretrain_vlm.py", data_root, tmp_path / "logs",
                                   "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
                                   "train.train_iters=3", timeout=540, preloaded=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3 and all("encoder max/mean vanilla" in ln for ln in lines), out[-2000:]
    print("\n".join(lines))
    assert sorted(logs) == [0, 1, 2, 3]

    losses = [s["loss"] for s in logs[0]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    for step in range(3):
        head = logs[0][step]
        planned = [tuple(k) for k in head["planned_keys"]]
        # every image of the step's samples is planned exactly once (the global batch holds images)
        assert len(planned) == len(set(planned)) == len(head["planned_ranks"]) >= 1
        for rank in range(4):  # every rank encoded exactly its planned share over WORLD
            mine = Counter(tuple(k) for k in logs[rank][step]["encoded_keys"])
            want = Counter(k for k, r in zip(planned, head["planned_ranks"], strict=True) if r == rank)
            assert mine == want
        assert sum(logs[r][step]["encoded_patches"] for r in range(4)) == sum(head["balance"]["patches_per_rank"])
        # the first-stage ranks (one per DP rank) embedded every planned image patch exactly once
        embedded = sum(logs[r][step]["image_tokens_embedded"] for r in range(4))
        assert embedded == sum(head["balance"]["patches_per_rank"])
        assert head["balance"]["encoder_max_over_mean"] <= head["balance"]["encoder_vanilla_max_over_mean"] + 1e-9
        # each image's patches reached one rank, its encoder rank, and nothing else: every rank's
        # patch bytes are exactly its encoder share (float32), none inside its microbatches
        for rank in range(4):
            got = logs[rank][step]
            assert got["patch_bytes"] == 4 * PATCH_DIM * got["encoded_patches"] < got["data_bytes"]
