"""VLM (LLaVA stage-1 style) pretraining with megatron-core, fed by the hybrid (Alg. 2) strategy.

    torchrun --nproc_per_node 4 examples/pretrain_vlm.py data.data_root=demo_data \
        parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=2 train.train_iters=3

Images are balanced over WORLD and encoded by a frozen megatron ViT on every rank; sequences
are balanced over DP for the GPT backbone, whose first stage embeds the projected image
features. Arguments are Hydra overrides of conf/train_vlm.yaml. Runs on CPU (gloo + shims).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from megascale_data_ext.config import compose_config
    from megascale_data_ext.megatron.pretrain_vlm import pretrain_vlm

    cfg = compose_config(argv, config_name="train_vlm")
    log = pretrain_vlm(cfg)
    log_dir = cfg.train.get("log_dir")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
