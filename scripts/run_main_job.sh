#!/usr/bin/env bash
# The main job: set up, then run the end-to-end demo (Ray service + torchrun megatron-core training).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/megascale-data demo "$@"
