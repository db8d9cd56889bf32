#!/usr/bin/env bash
# The project's GPU check, one command on any CUDA machine (CI has none and never runs it):
#     OUT=results bash scripts/gpu_check.sh
# from the repository root, with python3 = a CUDA torch and this package importable (pip install -e .,
# or PYTHONPATH=$PWD). Steps, each time-boxed against one deadline (GPU_CHECK_SECONDS, default 540):
#   1. kernels.json: CUDA sanity, every per-document attention kernel vs a dense fp64 reference (bf16, fp32)
#   2. gpu_balance.json: `bench gpu-balance` at caps 8192 and 4096, long-short / navit / coyo, DP 4
#      (launch-bound: launch_bound.json, device vs host launch time per microbatch, `gpu_check.py launch-bound`;
#      bench-large: gpu_balance_h4096.json, the same bench on a GPT of hidden 4096, 4 layers, whose
#      microbatches are device-bound at cap 4096 where hidden 2048's sit on the host's launch time)
#   3. gpu_train.json: examples/pretrain_gpt.py and examples/pretrain_vlm.py, 1 GPU, bf16, hidden 2048,
#      seq 4096, 20 steps, per-document attention (flex) and the same batches with dense attention
#   4. megatron_lm.json (only when MLM_DIR names a patched Megatron-LM tree, see
#      scripts/megatron_lm_check.sh): Megatron-LM's own pretrain_gpt.py fed by the service; runs beside
#      step 1 (its losses and delivery counts are the result, not its timings)
# Every JSON names the device, torch version and command. runbook.log has everything printed.
# Overrides for a CPU dry run of the plumbing: GPT_SHAPE, VLM_SHAPE, SEQ, TRAIN_ITERS, BENCH_ARGS, KC_LENS,
# BF16=false, DEMO_ROWS, BENCH_LARGE_ARGS. GPU_CHECK_STEPS picks steps (default "kernels launch-bound bench bench-large
# train"; 4 runs whenever MLM_DIR is set); TRAIN_RUNS picks training runs (default "gpt_flex gpt_dense vlm_flex vlm_dense").
# Every step with all four training runs takes ~610 s on an H100 (2026-11-28), more than one device-tool call's
# 600 s: there, run TRAIN_RUNS="gpt_flex vlm_flex", or split GPU_CHECK_STEPS over two calls.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
W=${GPU_CHECK_WORK:-/tmp/gpu_check}
rm -rf "$W" && mkdir -p "$W"
exec > >(tee -a "$OUT/runbook.log") 2>&1
T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_CHECK_SECONDS:-540}))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=4 TORCHINDUCTOR_CACHE_DIR=$W/inductor
export GPU_CHECK_COMMAND="OUT=$OUT bash scripts/gpu_check.sh"
HERE=$(cd "$(dirname "$0")" && pwd)
MSD=(python3 -m megascale_data_ext)
declare -A RC SECS

now() { date +%s; }
step() { echo; echo "=== [+$(( $(now) - T0 ))s] $*"; }
budget() { local left=$((DEADLINE - $(now) - 10)); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
run_timed() {  # run_timed NAME MAX cmd...: exit code and seconds into RC/SECS; a timeout is exit 124
  local name=$1 max=$2; shift 2
  local t; t=$(budget "$max"); local s; s=$(now)
  echo "--- $name (timeout ${t}s): $*"
  timeout --kill-after=10 "$t" "$@"; RC[$name]=$?
  SECS[$name]=$(( $(now) - s ))
  echo "--- $name: exit ${RC[$name]} after ${SECS[$name]}s$([ "${RC[$name]}" = 124 ] && echo ' (TIMED OUT)')"
}
ray_cleanup() { case "${RC[$1]:-0}" in 0) ;; *) timeout 30 python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true;; esac; }

step "0. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi failed"
python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
run_timed demo_data 60 "${MSD[@]}" demo-data --out "$W/demo_data" --rows "${DEMO_ROWS:-2000}"

MLM_PID=
if [ -n "${MLM_DIR:-}" ]; then
  step "4. (background) Megatron-LM pretrain_gpt.py fed by the service: $MLM_DIR"
  ( DATA_ROOT=$W/demo_data OUT=$W/mlm timeout --kill-after=10 "$(budget ${MLM_SECONDS:-240})" \
      bash "$HERE/megatron_lm_check.sh" > "$W/megatron_lm.log" 2>&1; echo "exit $?" >> "$W/megatron_lm.log" ) &
  MLM_PID=$!
fi

STEPS=" ${GPU_CHECK_STEPS:-kernels launch-bound bench bench-large train} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

want kernels && step "1. CUDA sanity + per-document attention kernels vs a dense reference"
want kernels && run_timed kernels 120 python3 "$HERE/gpu_check.py" kernels "$OUT/kernels.json"

if [ -n "$MLM_PID" ]; then
  step "4. waiting for the Megatron-LM run (timings below must not overlap it)"
  wait "$MLM_PID"; tail -25 "$W/megatron_lm.log"; cp "$W/mlm/megatron_lm.json" "$OUT/" 2>/dev/null
fi

want launch-bound && step "2a. launch-bound? device vs host launch time per microbatch, pinned vs pageable uploads"
want launch-bound && run_timed launch_bound 90 python3 "$HERE/gpu_check.py" launch-bound "$OUT/launch_bound.json"

want bench && step "2. bench gpu-balance, caps 8192 and 4096"
read -r -a BENCH_ARGS <<< "${BENCH_ARGS:---caps 8192 4096 --repeats 5}"
want bench && run_timed bench 200 "${MSD[@]}" bench gpu-balance --json "$OUT/gpu_balance.json" "${BENCH_ARGS[@]}"

want bench-large && step "2b. bench gpu-balance on a device-bound GPT (hidden 4096, 4 layers), caps 8192 and 4096"
read -r -a BENCH_LARGE_ARGS <<< "${BENCH_LARGE_ARGS:---caps 8192 4096 --repeats 3 --hidden 4096 --layers 4 --heads 32 --memory-pack 0}"
want bench-large && run_timed bench_large 170 "${MSD[@]}" bench gpu-balance --json "$OUT/gpu_balance_h4096.json" \
  "${BENCH_LARGE_ARGS[@]}"

SEQ=${SEQ:-4096}
read -r -a GPT_SHAPE <<< "${GPT_SHAPE:-model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16}"
read -r -a VLM_SHAPE <<< "${VLM_SHAPE:-model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16 vision.hidden_size=1024 vision.num_layers=4 vision.num_attention_heads=16}"
COMMON=(parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=1
  parallel.context_parallel_size=1 "train.bf16=${BF16:-true}" "data.seq_length=$SEQ" data.samples_per_step=64
  data.num_microbatches=4 "train.train_iters=${TRAIN_ITERS:-20}" train.lr_warmup_iters=4 train.lr=3.0e-4
  train.min_lr=3.0e-5 "data.data_root=$W/demo_data")
train_run() {  # train_run NAME EXAMPLE ATTENTION MAX SHAPE...: one torchrun of an example, 1 GPU
  local name=$1 example=$2 attention=$3 max=$4; shift 4
  step "3. $example, 1 GPU, bf16, attention=$attention, ${TRAIN_ITERS:-20} steps"
  export MEM_OUT=$W/$name.mem
  local args=("${COMMON[@]}" "$@" "model.attention=$attention" "train.log_dir=$W/${name}_log")
  run_timed "$name" "$max" python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    "$HERE/gpu_check.py" memwrap "examples/$example" "${args[@]}"
  ray_cleanup "$name"
  local hidden; hidden=$(printf '%s\n' "$@" | sed -n 's/^model.hidden_size=//p')
  python3 - "$W/$name.meta.json" "$example" "$attention" "$hidden" "$SEQ" "${RC[$name]}" "${BF16:-true}" "${args[*]}" <<'PY'
import json, sys
path, example, attention, hidden, seq, rc, bf16, args = sys.argv[1:]
json.dump({"example": example, "attention": attention, "dtype": "bf16" if bf16 == "true" else "fp32", "hidden": int(hidden), "seq_length": int(seq),
           "exit_code": int(rc), "command": f"torchrun --standalone --nproc_per_node 1 examples/{example} {args}"},
          open(path, "w"))
PY
}
RUNS=" ${TRAIN_RUNS:-gpt_flex gpt_dense vlm_flex vlm_dense} "
if want train; then
  [[ "$RUNS" == *" gpt_flex "* ]] && train_run gpt_flex pretrain_gpt.py flex 110 "${GPT_SHAPE[@]}"
  [[ "$RUNS" == *" vlm_flex "* ]] && train_run vlm_flex pretrain_vlm.py flex 100 "${VLM_SHAPE[@]}"
  [[ "$RUNS" == *" gpt_dense "* ]] && train_run gpt_dense pretrain_gpt.py dense 80 "${GPT_SHAPE[@]}"
  [[ "$RUNS" == *" vlm_dense "* ]] && train_run vlm_dense pretrain_vlm.py dense 80 "${VLM_SHAPE[@]}"
fi

step "5. summary"
want train && timeout 60 python3 "$HERE/gpu_check.py" train-rows "$OUT/gpu_train.json" "$W" gpt_flex vlm_flex gpt_dense vlm_dense
args=(); for k in "${!RC[@]}"; do args+=("$k=${RC[$k]}/${SECS[$k]}s"); done
tar -czf "$OUT/logs.tar.gz" -C "$W" --exclude demo_data --exclude inductor . 2>/dev/null || true
echo "=== done in $(( $(now) - T0 ))s; exit codes (code/seconds): ${args[*]}"
ls -la "$OUT"
