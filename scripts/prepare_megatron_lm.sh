#!/usr/bin/env bash
# Builds `.mlm/` (git-ignored): Megatron-LM core_v0.16.1's pretrain_gpt.py and `megatron/` tree with
# patches/pretrain_gpt.patch applied, for scripts/megatron_lm_check.sh on a machine without network.
# Megatron-LM's initialize runs `make` on megatron/core/datasets (helpers_cpp) on rank 0; the GPU
# machine may lack pybind11/python3-config, so the prebuilt cp312 helpers_cpp from the megatron-core
# 0.16.1 wheel (.device/whl, else pip download) goes into the tree, newer than helpers.cpp so make
# finds nothing to do. Only pretrain_gpt.py, its two builders and megatron/ are taken (about 8 MB).
#     bash scripts/prepare_megatron_lm.sh        (MEGATRON_LM_REPO=<git dir or clone> to override)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
repo=${MEGATRON_LM_REPO:-/work/.mirror/NVIDIA+Megatron-LM/repo}
ref=${MEGATRON_LM_REF:-core_v0.16.1}
if [ -d "$repo/.git" ]; then gitdir="$repo/.git"; else gitdir="$repo"; fi
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
grep -qx '/.mlm/' "$ex" 2>/dev/null || echo '/.mlm/' >> "$ex"
rm -rf .mlm && mkdir .mlm
git --git-dir="$gitdir" archive "$ref" megatron pretrain_gpt.py gpt_builders.py model_provider.py | tar -x -C .mlm
# megatron/rl, core/export and core/resharding are imported by megatron.training: all of megatron/ is kept
find .mlm -name '*.md' -delete
git -C .mlm init -q && git -C .mlm apply --check "$root/patches/pretrain_gpt.patch" \
  && git -C .mlm apply "$root/patches/pretrain_gpt.patch" && rm -rf .mlm/.git
grep -q 'megascale_data_ext.megatron.provider' .mlm/pretrain_gpt.py
whl=$(ls .device/whl/megatron_core-0.16.1-cp312-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" megatron-core==0.16.1
  whl=$(ls "$tmp"/megatron_core-0.16.1-cp312-*.whl)
fi
python3 - "$whl" <<'PY'
import sys, zipfile
name = "megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so"
with zipfile.ZipFile(sys.argv[1]) as z, open(".mlm/" + name, "wb") as f:
    f.write(z.read(name))
PY
strip --strip-unneeded .mlm/megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so 2>/dev/null || true
touch .mlm/megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so  # newer than helpers.cpp: make is a no-op
# megatron.training imports pydantic (megatron/rl), which megatron-core does not need: carry it as cp312 wheels
mkdir -p .mlm/whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .mlm/whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
git --git-dir="$gitdir" rev-parse "$ref^{commit}" > .mlm/REVISION
du -sh .mlm; echo "ready: .mlm ($ref $(cut -c1-12 .mlm/REVISION), pretrain_gpt.patch applied); carry it with .device"
