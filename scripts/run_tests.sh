#!/usr/bin/env bash
# Set up, then run the whole test suite (slow multi-process tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -W ignore::DeprecationWarning -W ignore::UserWarning --timeout=600 "$@"
