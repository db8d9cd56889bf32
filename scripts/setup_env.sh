#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch and this package; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first, pinned: 2.13.0 resolves to the local CPU build; a bare `torch` would pull CUDA wheels.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# megatron-core pinned to the version the whole suite runs on (docs/compatibility.md): on Python 3.12 pip would
# otherwise take 0.19.x, which imports triton at import time (absent from a CPU torch build).
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" "megatron-core==0.16.1"
