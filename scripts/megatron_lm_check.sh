#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py (core_v0.16.1 + patches/pretrain_gpt.patch, built into .mlm by
# scripts/prepare_megatron_lm.sh) trains a small GPT for ITERS steps on 1 GPU, fed by `serve`
# (world size 1, embedded Ray). Writes $OUT/megatron_lm.json (losses, delivered samples, duplicates)
# even on failure (with the error tail). Every phase is under `timeout`: < ~200 s in all.
#     source .device/env.sh && DATA_ROOT=/tmp/demo OUT=$OUT bash scripts/megatron_lm_check.sh
set -uo pipefail
MLM_DIR=$(cd "${MLM_DIR:-.mlm}" && pwd); OUT=${OUT:?set OUT}; DATA_ROOT=${DATA_ROOT:?set DATA_ROOT}
SEQ=${SEQ:-2048}; NMB=${NMB:-4}; ITERS=${ITERS:-20}; PY=${PYTHON:-python3}
W=$(mktemp -d); mkdir -p "$OUT"; NS=mlm-check-$$
export MEGASCALE_DELIVERY_LOG=$W/delivered.jsonl MEGASCALE_PACKED_SEQ=0 PYTHONUNBUFFERED=1
# Megatron's initialize runs `make` (helpers_cpp; .mlm carries the prebuilt .so) and `$CUDA_HOME/bin/nvcc -V`
# (fused_kernels.load, which compiles nothing): without make/python3-config or a CUDA toolkit, shims answer.
shims=""
# pydantic (megatron.training imports it) from the wheels prepare_megatron_lm.sh put in the tree, where it is missing
if ! $PY -c "import pydantic" 2>/dev/null && ls "$MLM_DIR"/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$MLM_DIR"/whl/*.whl \
    && export PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH} && shims="pydantic-wheels"
fi
mkdir -p "$W/bin" "$W/cuda/bin"
if ! (command -v make >/dev/null && make -q -C "$MLM_DIR/megatron/core/datasets" >/dev/null 2>&1); then
  printf '#!/bin/sh\necho "[shim] make skipped: prebuilt helpers_cpp in the tree"\n' > "$W/bin/make"; chmod +x "$W/bin/make"
  export PATH=$W/bin:$PATH; shims="make"
fi
if ! timeout 60 $PY -c "import os,sys; from torch.utils.cpp_extension import CUDA_HOME as h; sys.exit(not (h and os.path.exists(h+'/bin/nvcc')))" 2>/dev/null; then
  printf '#!/bin/sh\necho "Cuda compilation tools, release 12.8, V12.8.93"\n' > "$W/cuda/bin/nvcc"; chmod +x "$W/cuda/bin/nvcc"
  export CUDA_HOME=$W/cuda; shims="$shims nvcc"
fi
SERVE=($PY -m megascale_data_ext serve "data.data_root=$DATA_ROOT" "data.ray.namespace=$NS" data.ray.num_cpus=4
       data.samples_per_step=8 "data.seq_length=$SEQ" "data.num_microbatches=$NMB" --world-size 1 --tp 1 --pp 1
       --status-every 0 --env-file "$W/serve.env")
timeout -k 5 170 "${SERVE[@]}" > "$W/serve.log" 2>&1 & SPID=$!
for _ in $(seq 120); do [ -f "$W/serve.env" ] || ! kill -0 $SPID 2>/dev/null && break; sleep 0.5; done
CMD=()
rc=0; stage=serve
if [ -f "$W/serve.env" ]; then
  source "$W/serve.env"; unset MEGASCALE_NUM_MICROBATCHES  # Megatron's calculator must agree by itself
  stage=megatron
  CMD=($PY -m torch.distributed.run --standalone --nproc_per_node 1 "$MLM_DIR/pretrain_gpt.py"
       --dataloader-type external --transformer-impl local --tensor-model-parallel-size 1
       --pipeline-model-parallel-size 1 --context-parallel-size 1 --micro-batch-size 1 --global-batch-size "$NMB"
       --seq-length "$SEQ" --max-position-embeddings "$SEQ" --num-layers 8 --hidden-size 1024
       --num-attention-heads 16 --ffn-hidden-size 4096 --position-embedding-type rope --normalization LayerNorm
       --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0
       --train-iters "$ITERS" --log-interval 1 --eval-iters 0 --eval-interval 1000000
       --tokenizer-type NullTokenizer --vocab-size 259 --no-gradient-accumulation-fusion --no-masked-softmax-fusion
       --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
       --no-create-attention-mask-in-dataloader --attention-backend unfused --seed 1234 --distributed-backend nccl)
  PYTHONPATH="$MLM_DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 ${MLM_TIMEOUT:-150} "${CMD[@]}" > "$W/megatron.log" 2>&1
  rc=$?
else
  rc=97
fi
kill -TERM $SPID 2>/dev/null; timeout 60 tail --pid=$SPID -f /dev/null; kill -KILL $SPID 2>/dev/null
cp "$W/serve.log" "$W/megatron.log" "$W/delivered.jsonl" "$OUT/" 2>/dev/null
RC=$rc STAGE=$stage SHIMS="$shims" W="$W" OUTF="$OUT/megatron_lm.json" ITERS=$ITERS \
  timeout 60 $PY - "${CMD[@]}" <<'PY'
import json, os, re, shlex, sys
W, rc = os.environ["W"], int(os.environ["RC"])
def read(name):
    try: return open(os.path.join(W, name), errors="replace").read()
    except OSError: return ""
log = read("megatron.log")
losses = [float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)", log)]
recs = [json.loads(l) for l in read("delivered.jsonl").splitlines() if l.strip()]
keys = [(s[0], s[1]) for r in recs for s in r["samples"]]          # (source, stream position)
mbs = [(r["rank"], r["step"], r["microbatch"]) for r in recs]
dups = len(keys) - len(set(keys))
try:
    import torch; tv, dev = torch.__version__, (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
except Exception as e: tv, dev = None, f"unknown ({e})"
res = {"command": shlex.join(sys.argv[1:]), "device": dev, "torch": tv, "rc": rc, "stage": os.environ["STAGE"],
       "shims": os.environ["SHIMS"].split(), "steps": len(losses), "first_loss": losses[0] if losses else None,
       "last_loss": losses[-1] if losses else None, "losses": losses, "microbatches_delivered": len(recs),
       "microbatch_duplicates": len(mbs) - len(set(mbs)), "samples_delivered": len(keys), "duplicates": dups,
       "delivered_exactly_once": bool(keys) and dups == 0 and len(mbs) == len(set(mbs)),
       "ok": rc == 0 and len(losses) >= int(os.environ["ITERS"]) and bool(keys) and dups == 0}
if not res["ok"]:
    res["error_tail"] = (log or read("serve.log"))[-4000:]
    res["serve_tail"] = read("serve.log")[-1500:]
open(os.environ["OUTF"], "w").write(json.dumps(res, indent=1))
print(json.dumps({k: v for k, v in res.items() if k not in ("losses", "error_tail", "serve_tail")}))
PY
