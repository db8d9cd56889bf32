#!/usr/bin/env bash
# The main job: set up, then run the end-to-end demo (Ray service + torchrun megatron-core training).
# Extra args go to `megascale-data demo`, e.g. `--tp 1 --pp 1 --cp 2 --dp 2` (context parallel: each rank
# trains on its zigzag slice of every document) or `--bf16` on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/megascale-data demo "$@"
