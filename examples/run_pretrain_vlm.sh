#!/usr/bin/env bash
# Demo data (once), then VLM pretraining at TP1·PP2·DP2 on 4 CPU processes; extra args are Hydra overrides
# or flags (--config-dir DIR --config-name NAME; `python examples/pretrain_vlm.py --help` lists them).
# Same recipe and devices as run_pretrain_gpt.sh (warm-up, cosine decay, clipping; cuda:LOCAL_RANK when CUDA is
# present, the frozen ViT and projector included), e.g. NPROC=1 ... parallel.pipeline_model_parallel_size=1 train.bf16=true
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -d demo_data/valid-text ] || "$PY" -m megascale_data_ext demo-data --out demo_data
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-4}" \
  examples/pretrain_vlm.py data.data_root="$PWD/demo_data" "$@"
