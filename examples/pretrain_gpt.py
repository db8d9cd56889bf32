"""GPT pretraining with megatron-core, fed by the MegaScale-Data service.

    torchrun --nproc_per_node 4 examples/pretrain_gpt.py data.data_root=demo_data \
        parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=2 train.train_iters=5

Arguments are Hydra overrides of conf/train_gpt.yaml (composed with `defaults: [data: megascale, ...]`),
e.g. `strategy=vanilla`, `data.seq_length=2048`, `data.ray.address=auto`, `train.save=ckpt
train.save_interval=2`, `train.load=ckpt`. Runs on CPU (gloo + the shims in
megascale_data_ext/patches/cpu.py) and unchanged on GPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from megascale_data_ext.config import compose_config
    from megascale_data_ext.megatron.pretrain import pretrain_gpt

    cfg = compose_config(argv, config_name="train_gpt")
    log = pretrain_gpt(cfg)
    log_dir = cfg.train.get("log_dir")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
