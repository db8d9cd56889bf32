#!/usr/bin/env bash
# Run Megatron-LM's own builder test suite (tests/unit_tests/data/test_builder.py at a tag,
# default core_v0.16.1) against MegascaleDatasetBuilder, on CPU, in a temporary directory.
# Nothing is copied into the project; this script is not part of the default test suite.
#
# Three runs of the same file:
#   megatron  - verbatim (Megatron's builder), the reference
#   swapped   - one line changed: `from megascale_data_ext.megatron.builder import
#               MegascaleDatasetBuilder as BlendedMegatronDatasetBuilder`
#   cross     - only the second ("fast") build in test_fast_builder uses our builder, so the
#               file's own equality checks compare Megatron's datasets with ours
#
# Usage: scripts/check_megatron_builder_suite.sh [MEGATRON_LM_GIT_DIR] [TAG]
#   MEGATRON_LM_GIT_DIR: a Megatron-LM git dir (bare is fine); default $MEGATRON_LM_GIT or
#   /work/.mirror/NVIDIA+Megatron-LM/repo. Needs the project venv active (megatron-core with
#   compiled helpers_cpp). MBT_DEPS: a pip --target dir to reuse for regex + triton (imported
#   by megatron.training, which the test file imports; megatron-core does not ship them).
set -euo pipefail

repo="${1:-${MEGATRON_LM_GIT:-/work/.mirror/NVIDIA+Megatron-LM/repo}}"
tag="${2:-core_v0.16.1}"
project="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d -t megatron_builder_suite.XXXXXX)"
deps="${MBT_DEPS:-$work/deps}"
trap 'rm -rf "$work"' EXIT

python -c "import torch, megatron.core.datasets.helpers_cpp" 2>/dev/null \
  || { echo "error: python lacks torch or megatron-core's compiled helpers: activate the project venv" \
            "(source .venv/bin/activate)" >&2; exit 2; }
git -C "$repo" rev-parse --verify -q "$tag^{commit}" >/dev/null \
  || { echo "error: $repo has no tag $tag (pass a Megatron-LM git dir and tag)" >&2; exit 2; }
git -C "$repo" archive "$tag" megatron/training megatron/legacy megatron/post_training megatron/rl \
  tools/__init__.py tools/build_sequences_per_dataset.py tests/__init__.py tests/unit_tests/__init__.py \
  tests/unit_tests/test_utilities.py tests/unit_tests/dist_checkpointing/__init__.py \
  tests/unit_tests/dist_checkpointing/utils.py tests/unit_tests/data/__init__.py \
  tests/unit_tests/data/test_builder.py | tar -x -C "$work"

python -c "import regex, triton" 2>/dev/null || [ -d "$deps/triton" ] \
  || python -m pip install -q --no-deps --target "$deps" regex triton

# Harness only (the test file is untouched): upstream's conftest downloads data and its
# Utils initialises NCCL on CUDA; here torch.distributed runs on gloo with one CPU rank.
cat > "$work/conftest.py" <<'PY'
import os
from datetime import timedelta

import pytest
import torch

import megatron.core.datasets.utils as mcd_utils

mcd_utils.compile_helpers = lambda: None  # the wheel ships helpers_cpp compiled (and no Makefile)

from tests.unit_tests.dist_checkpointing import TempNamedDir  # noqa: E402
from tests.unit_tests.test_utilities import Utils  # noqa: E402


def _init_gloo():
    if not torch.distributed.is_initialized():
        store = torch.distributed.FileStore(os.path.join(os.environ["MBT_WORK"], "store"), 1)
        torch.distributed.init_process_group("gloo", world_size=1, rank=0, store=store, timeout=timedelta(minutes=1))
    Utils.inited = True


Utils.initialize_distributed = staticmethod(_init_gloo)


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory):
    tmp_dir = tmp_path_factory.mktemp("ignored", numbered=False).parent.parent / "tmp_dist_ckpt"
    with TempNamedDir(tmp_dir, sync=False):
        yield tmp_dir
PY

data="$work/tests/unit_tests/data"
import_line='from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder'
ours='from megascale_data_ext.megatron.builder import MegascaleDatasetBuilder'
grep -qx "$import_line" "$data/test_builder.py" || { echo "error: import line not found in $tag's test file" >&2; exit 2; }
sed "s|^$import_line\$|$ours as BlendedMegatronDatasetBuilder|" "$data/test_builder.py" > "$data/test_builder_swapped.py"
sed -e "s|^$import_line\$|&\n$ours|" \
    -e 's|^\(\s*train_ds_fast, valid_ds_fast, test_ds_fast = \)BlendedMegatronDatasetBuilder(|\1MegascaleDatasetBuilder(|' \
    "$data/test_builder.py" > "$data/test_builder_cross.py"
echo "== changes to $tag:tests/unit_tests/data/test_builder.py"
diff "$data/test_builder.py" "$data/test_builder_swapped.py" || true
diff "$data/test_builder.py" "$data/test_builder_cross.py" || true

status=0
mkdir -p "$work/pt"  # pytest creates --basetemp but not its parent
for variant in megatron swapped cross; do
  file="$data/test_builder.py"; [ "$variant" = megatron ] || file="$data/test_builder_${variant}.py"
  echo "== $variant"
  (cd "$work" && MBT_WORK="$work" PYTHONPATH="$work:$deps:$project${PYTHONPATH:+:$PYTHONPATH}" \
     python -m pytest -q -p no:cacheprovider -W ignore --show-capture=no --basetemp="$work/pt/$variant" "$file" \
     > "$work/$variant.log" 2>&1) || status=1
  grep -E '^(FAILED|ERROR)|passed|failed|error' "$work/$variant.log" || tail -20 "$work/$variant.log"
done
exit $status
