"""One trainer rank of the main job: megatron-core GPT trained on the service's batches.

Run under torchrun (``python -m torch.distributed.run ... -m megascale_data_ext.trainer.train_worker``).
Each rank initialises torch.distributed (gloo on CPU; NCCL for CUDA tensors on ``cuda:LOCAL_RANK``
when CUDA is present) + Megatron's `parallel_state`, builds its `ClientPlaceTree` from Megatron; rank 0 asks the service's Planner for its `ServiceTopology` and shares it, fetching
ranks join the Ray cluster of the service on their first fetch, and every rank trains through
`get_forward_backward_func` on the delivered microbatches (per-document attention; with CP > 1
each rank trains on its zigzag slice of every document). Optimizer: `pretrain.build_optimizer`'s
AdamW with warm-up + cosine decay, clipped grads. Rank 0 prints one line per step;
every rank writes ``rank<N>.json`` (losses, delivered sample ids, fetch latencies) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--num-microbatches", type=int, required=True)
    p.add_argument("--samples-per-step", type=int, default=None, help="the service's (to count deferred samples)")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--attention", default="auto", help="auto|te|flex|dense (trainer/attention.py)")
    p.add_argument("--bf16", action="store_true", help="Megatron bf16 mixed precision")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=1, help="linear LR warm-up steps")
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--namespace", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--record-digests", action="store_true", help="log a SHA-1 of every delivered microbatch")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-train", action="store_true", help="only consume batches (accounting tests)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megascale_data_ext.trainer.app import quiet_imports

    quiet_imports()  # megatron-core's TE/Apex fallback notices: the CPU run uses the fallbacks on purpose
    from omegaconf import OmegaConf

    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.megatron.groups import broadcast_group
    from megascale_data_ext.trainer.model import GPTModelConfig, build_model_chunks, initialize_parallel
    from megascale_data_ext.trainer.step import train_step
    from megascale_data_ext.trainer.optimizer import build_optimizer
    from megascale_data_ext.trainer.pretrain import step_counts
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.runtime.remote import RemoteConstructors, fetch_topology

    vocab = -(-args.vocab_size // (64 * args.tp)) * 64 * args.tp  # pad like --make-vocab-size-divisible-by
    cfg = GPTModelConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
        seq_length=args.seq_length, tp=args.tp, pp=args.pp, cp=args.cp, attention=args.attention, bf16=args.bf16,
    )
    initialize_parallel(cfg)
    rank = dist.get_rank()
    tree = ClientPlaceTree.from_megatron()
    shared = [fetch_topology(args.address, args.namespace) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    topology = shared[0]
    if topology.tree.layout() != tree.layout():
        raise SystemExit(f"the service plans for {topology.tree.layout()}, this job runs {tree.layout()}")
    client = Client(
        topology, rank, source=RemoteConstructors(topology, args.address), num_microbatches=args.num_microbatches,
        broadcast_group=broadcast_group(topology), record_digests=args.record_digests,
    )
    chunks = optimizer = scheduler = None
    if not args.no_train:
        chunks = build_model_chunks(cfg)
        recipe = OmegaConf.create({"lr": args.lr, "train_iters": args.start_step + args.steps,
                                   "lr_warmup_iters": args.warmup, "lr_decay_style": "cosine", "min_lr": args.lr / 10})
        optimizer, scheduler = build_optimizer(chunks, recipe, bf16=cfg.bf16)
        for _ in range(args.start_step):  # a resumed job continues the schedule where it was
            scheduler.step()
    planner = None
    if rank == 0:
        from megascale_data_ext.runtime.remote import find_planner

        planner = find_planner(args.namespace)
    log: dict = {"rank": rank, "coords": tree.coords(rank), "steps": []}
    for step in range(args.start_step, args.start_step + args.steps):
        t0 = time.perf_counter()
        client.drain()
        if args.no_train:
            tokens = 0
            for batch in client.step_iterator(step):
                t = batch.get("tokens", batch.get("labels"))
                tokens += 0 if t is None else int(t.numel())
            result = {"loss": float("nan"), "num_tokens": float(tokens)}
        else:
            result = train_step(chunks, optimizer, client.step_iterator(step), num_microbatches=args.num_microbatches,
                                seq_length=args.seq_length, clip_grad=args.clip_grad, scheduler=scheduler)
        dt = time.perf_counter() - t0
        records = client.drain()
        infos, fetch = records["delivered"], records["fetch_seconds"]
        entry = {
            "step": step,
            "loss": result["loss"],
            "num_tokens": result["num_tokens"],
            "seconds": dt,
            "fetch_ms": [1e3 * f for f in fetch],
            "samples": [np.asarray(i["samples"]).tolist() for i in infos if i is not None],
            "microbatch_tokens": [i["tokens"] for i in infos if i is not None],
            "digests": records["digests"],
        }
        log["steps"].append(entry)
        if rank == 0:
            import ray

            s = ray.get(planner.plan_summary.remote(step))
            tps = result["num_tokens"] / dt if dt > 0 else 0.0
            wait = float(np.sum(fetch)) * 1e3  # rank 0's time waiting on the service this step
            print(
                f"step {step:3d} | loss {result['loss']:.4f} | imbalance max/mean vanilla {s.get('vanilla_max_over_mean', float('nan')):.3f}"
                f" -> balanced {s['max_over_mean']:.3f} | {step_counts(s, args)} tokens {s['tokens']}"
                f" | {tps:,.0f} loss-tokens/s | data wait {wait:.1f} ms | step {dt:.2f} s",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(log))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megascale_data_ext.trainer.app import exit_process

    exit_process(main())
