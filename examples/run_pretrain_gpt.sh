#!/usr/bin/env bash
# Demo data (once), then GPT pretraining at TP2·PP2 on 4 CPU processes; extra args are Hydra overrides
# or flags (--config-dir DIR --config-name NAME; `python examples/pretrain_gpt.py --help` lists them).
# The recipe (conf/train_gpt.yaml, train.*): AdamW, linear warm-up, cosine decay to min_lr, grad clipping 1.0;
# attention per document (model.attention=auto: Transformer Engine's THD attention when installed, else the
# project's). With CUDA every process trains on cuda:LOCAL_RANK (NCCL); one GPU, bf16, a 2048-wide model:
#   NPROC=1 examples/run_pretrain_gpt.sh parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=1 \
#     train.bf16=true model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16 data.seq_length=4096 \
#     train.train_iters=20 train.lr_warmup_iters=4 train.lr=3.0e-4 train.min_lr=3.0e-5
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -d demo_data/valid-text ] || "$PY" -m megascale_data_ext demo-data --out demo_data
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-4}" \
  examples/pretrain_gpt.py data.data_root="$PWD/demo_data" "$@"
