"""Helpers of scripts/gpu_check.sh (the project's GPU check); each subcommand is one step's tool.

    python3 scripts/gpu_check.py kernels OUT.json          per-document attention kernels vs a dense fp64 reference
    python3 scripts/gpu_check.py memwrap SCRIPT ARGS...    run SCRIPT, write this rank's CUDA peak memory to $MEM_OUT.<rank>
    python3 scripts/gpu_check.py train-rows OUT.json WORK RUN...   gpu_train.json from the runs' step logs
    python3 scripts/gpu_check.py launch-bound OUT.json      device vs host launch time of the GPT per microbatch

Every JSON it writes names the device, torch version and command, so a file read alone says
where its numbers come from.
"""

from __future__ import annotations

import glob
import json
import os
import runpy
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA device)", "torch": torch.__version__,
            "cuda": torch.version.cuda, "command": os.environ.get("GPU_CHECK_COMMAND", "bash scripts/gpu_check.sh")}


def kernels(out_path: str) -> int:
    """Every kernel of DocumentAttention (sdpa, compiled flex, flash varlen, the auto pick) in bf16
    and fp32 against a dense fp64 reference: output and dq relative errors, first-call and steady ms."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megascale_data_ext.trainer import attention as A
    from megascale_data_ext.trainer.model import GPTModelConfig, initialize_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("KC_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    out: dict[str, Any] = {**provenance(), "checks": []}
    if cuda:
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        for _ in range(3):  # cuBLAS initialisation and clocks out of the timed window
            a @ a
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        out["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12, 1)
    out["transformer_engine"] = A.te_available()
    out["shims"] = initialize_parallel(GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4))
    out["auto_resolves_to"] = {"bf16": A.resolve_attention("auto"), "fp32": A.resolve_attention("auto", half=False)}
    lens = [int(x) for x in os.environ.get("KC_LENS", "1000,37,1,500,2558").split(",")]  # a 1-token document too
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T, H, D = int(cu[-1]), 16, 64
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(T, H, D, generator=g) for _ in range(3)]
    mask = ~A.dense_document_mask(cu, T, dev)[0, 0]
    q, k, v = [x.to(dev).double().requires_grad_(True) for x in base]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    ref = ref.transpose(0, 1).reshape(T, -1)
    ref.float().square().sum().backward()
    r_out, r_dq = ref.detach().float(), q.grad.float()
    config = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, use_cpu_initialization=not cuda,
                               attention_dropout=0.0)
    for dtype in (torch.bfloat16, torch.float32):
        for kernel in (["sdpa", "flex", "varlen", None] if cuda else ["sdpa", "flex"]):
            if kernel == "varlen" and dtype == torch.float32:
                continue  # flash varlen is fp16/bf16 only
            rec: dict[str, Any] = {"kernel": kernel or "auto-picked", "dtype": str(dtype).split(".")[-1]}
            try:
                attn = A.DocumentAttention(config, 1, AttnMaskType.causal, "self", kernel=kernel)
                # device tensors, max_seqlen included, as a batch moved to the GPU carries them
                params = A.packed_seq_params({"cu_seqlens": torch.tensor(cu, device=dev),
                                              "max_seqlen": torch.tensor([max(lens)], device=dev)}, dev)
                grad = cuda or kernel != "flex"  # flex has no CPU backward (a CPU dry run checks the forward)
                xs = [x.to(dev, dtype).requires_grad_(grad) for x in base]
                if kernel is None:
                    rec["picked"] = A._pick_kernel(xs[0], xs[1], A._Layout(params, 1, 0, dev))
                times = []
                for _ in range(4):
                    for x in xs:
                        x.grad = None
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = attn(*xs, None, packed_seq_params=params)
                    if grad:
                        o.float().square().sum().backward()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                rec.update(first_call_s=round(times[0], 3), steady_ms=round(1e3 * min(times[1:]), 3),
                           out_rel_err=float((o.float() - r_out).abs().max() / r_out.abs().max()))
                if grad:
                    rec["dq_rel_err"] = float((xs[0].grad.float() - r_dq).abs().max() / r_dq.abs().max())
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-3
                rec["ok"] = rec["out_rel_err"] < tol and rec.get("dq_rel_err", 0.0) < tol
            except Exception as e:  # noqa: BLE001 - every kernel is reported, a failure included
                rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:600], where=traceback.format_exc().splitlines()[-3:])
            print(json.dumps(rec), flush=True)
            out["checks"].append(rec)
    out["ok"] = all(c.get("ok") for c in out["checks"])
    Path(out_path).write_text(json.dumps(out, indent=1))
    print("kernels:", "all ok" if out["ok"] else "FAILURES (see above)")
    return 0 if out["ok"] else 1


def memwrap(script: str, *args: str) -> None:
    """Run `script` as __main__; at exit write this rank's CUDA peak memory to $MEM_OUT.<rank>."""
    import atexit

    def dump() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rank = int(os.environ.get("RANK", 0))
            Path(f"{os.environ['MEM_OUT']}.{rank}").write_text(json.dumps({
                "rank": rank, "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}))

    atexit.register(dump)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def train_row(work: str, run: str) -> dict[str, Any]:
    """One gpu_train.json row from a run's step log (rank0.json) and its peak-memory file."""
    meta = json.loads(Path(f"{work}/{run}.meta.json").read_text())
    row: dict[str, Any] = {**meta, "steps": 0, "first_loss": None, "last_loss": None, "tokens_per_s": None,
                           "step_s_median": None, "peak_mem_gb": None, "exit_code": meta.get("exit_code")}
    log_path = Path(f"{work}/{run}_log/rank0.json")
    if log_path.exists():
        log = json.loads(log_path.read_text())
        secs = [e["seconds"] for e in log]
        warm = log[2:] or log  # the first steps compile kernels and warm the allocator
        row.update(steps=len(log), first_loss=log[0]["loss"] if log else None, last_loss=log[-1]["loss"] if log else None,
                   losses=[e["loss"] for e in log],
                   tokens_per_s=round(sum(e["num_tokens"] for e in warm) / sum(e["seconds"] for e in warm), 1)
                   if warm else None,
                   step_s_median=round(statistics.median(e["seconds"] for e in warm), 4) if warm else None,
                   first_step_s=round(secs[0], 3) if secs else None,
                   data_wait_ms_median=round(statistics.median(e.get("data_wait_ms", 0) for e in log), 2) if log else None)
    mems = [json.loads(Path(p).read_text()) for p in glob.glob(f"{work}/{run}.mem.*")]
    if mems:
        row["peak_mem_gb"] = round(max(m["max_allocated_gib"] for m in mems) * 2**30 / 1e9, 3)
        row["peak_reserved_gb"] = round(max(m["max_reserved_gib"] for m in mems) * 2**30 / 1e9, 3)
    losses = row.get("losses") or []
    row["finite_and_falling"] = bool(losses) and all(l == l and abs(l) != float("inf") for l in losses) \
        and losses[-1] < losses[0]
    return row


def train_rows(out_path: str, work: str, *runs: str) -> int:
    where = provenance()
    rows = [{**train_row(work, r), "device": where["device"]} for r in runs if Path(f"{work}/{r}.meta.json").exists()]
    Path(out_path).write_text(json.dumps({**where, "rows": rows}, indent=1))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "losses"}))
    return 0


def launch_bound(out_path: str) -> int:
    """Is a microbatch's time the device's or the host's? The bench's GPT (GPU default shape) on
    packs of 1,024-8,192 tokens, one to 64 documents: CUDA-event time vs the host's time to launch
    forward + backward; the attention layout uploaded from pinned vs pageable memory; one
    workload's balanced ranks timed back to back and interleaved (state vs content); and
    torch.profiler's host ops, synchronisations and device-busy time for one rank."""
    from dataclasses import asdict

    import numpy as np
    import torch

    from megascale_data_ext.commands import _profile_model as pm
    from megascale_data_ext.commands.bench_gpu_balance import plan_row
    from megascale_data_ext.dataplane.costs import TransformerCost
    from megascale_data_ext.trainer import attention as A

    cuda = torch.cuda.is_available()
    seq = 8192 if cuda else 256
    shape = pm.resolve_shape(hidden=None, layers=None, heads=None, vocab=None, seq=seq)
    out: dict[str, Any] = {**provenance(), "shape": asdict(shape), "packs": [], "uploads": [], "rank_state": []}
    rng = np.random.default_rng(0)

    def split(total: int, n: int) -> list[int]:
        total = max(n, total * seq // 8192)
        cuts = np.sort(rng.choice(np.arange(1, total), size=n - 1, replace=False)) if n > 1 else []
        return np.diff(np.concatenate(([0], cuts, [total]))).astype(int).tolist()

    packs = {f"{t}x{n}": split(t, n) for t, n in ((1024, 1), (2048, 1), (4096, 1), (3790, 11), (4096, 64),
                                                   (6144, 1), (6144, 16), (8192, 1), (8192, 64))}

    def timed(pack: list[int], reps: int = 5) -> dict[str, Any]:
        dev: list[float] = []
        host: list[float] = []
        for _ in range(reps):  # a rank of 4 equal microbatches, as the bench times a rank
            dev += timer.time_rank([pack] * 4)
            host += timer.host_seconds
        return {"tokens": sum(pack), "documents": len(pack), "device_ms_median": 1e3 * statistics.median(dev),
                "device_ms_min": 1e3 * min(dev), "device_ms_max": 1e3 * max(dev),
                "host_ms_median": 1e3 * statistics.median(host)}

    with pm.single_process_megatron(device=shape.device):
        timer = pm.ModelTimer(shape)
        timer.time_rank([[seq]])
        for name, pack in packs.items():
            out["packs"].append({"pack": name, **timed(pack)})
            print(json.dumps(out["packs"][-1]), flush=True)
        pinned = A._upload

        def pageable(a: Any, device: Any) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

        for name in ("4096x1", "3790x11", "8192x64"):
            for label, fn in (("pinned", pinned), ("pageable", pageable), ("pinned", pinned), ("pageable", pageable)):
                A._upload = fn
                out["uploads"].append({"pack": name, "uploads": label, **timed(packs[name], reps=3)})
                print(json.dumps(out["uploads"][-1]), flush=True)
        A._upload = pinned
        ranks, _, _ = plan_row("coyo", dp=4, m=4, cap=seq // 2, fill=0.9, seed=0, method="kk",
                               cost=TransformerCost(shape.cost_config()))
        balanced = ranks["balanced"]

        def rank_run(order: str, r: int) -> None:
            device = timer.time_rank(balanced[r])
            out["rank_state"].append({"order": order, "rank": r, "device_ms": [round(1e3 * d, 3) for d in device],
                                      "host_ms": [round(1e3 * h, 3) for h in timer.host_seconds],
                                      "microbatches": [[sum(mb), len(mb)] for mb in balanced[r]]})

        for r in range(len(balanced)):
            for _ in range(3):
                rank_run("back-to-back", r)
        for _ in range(3):
            for r in rng.permutation(len(balanced)):
                rank_run("interleaved", int(r))
        for rec in out["rank_state"]:
            print(json.dumps(rec), flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            timer.time_rank(balanced[0])
        events = prof.key_averages()

        def device_ms(e: Any) -> float:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))) / 1e3

        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
        out["profile"] = {
            "rank": [[sum(mb), len(mb)] for mb in balanced[0]],
            "device_ms_unprofiled": [round(1e3 * d, 3) for d in timer.time_rank(balanced[0])],
            "self_cpu_ms_total": sum(e.self_cpu_time_total for e in events) / 1e3,
            "self_device_ms_total": sum(device_ms(e) for e in events),
            "host_ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "launches": sum(e.count for e in events if "LaunchKernel" in e.key),
            "syncs_and_copies": {e.key: {"count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in events
                                 if "ynchronize" in e.key or "emcpy" in e.key or "Memset" in e.key},
            "top_self_cpu": [{"name": e.key, "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                              "self_device_ms": round(device_ms(e), 3)} for e in top]}
        print(json.dumps({k: v for k, v in out["profile"].items() if k != "top_self_cpu"}), flush=True)
    Path(out_path).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, *rest = argv
    if cmd == "kernels":
        return kernels(*rest)
    if cmd == "memwrap":
        memwrap(*rest)
        return 0
    if cmd == "train-rows":
        return train_rows(*rest)
    if cmd == "launch-bound":
        return launch_bound(*rest)
    print(f"unknown subcommand {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
