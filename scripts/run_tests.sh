#!/usr/bin/env bash
# Set up, then run the whole test suite (slow multi-process tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# faulthandler on through interpreter exit: a crash there prints every thread's stack, not just rc 139
export PYTHONFAULTHANDLER=1
exec .venv/bin/python -m pytest -q -W ignore::DeprecationWarning -W ignore::UserWarning --timeout=600 "$@"
