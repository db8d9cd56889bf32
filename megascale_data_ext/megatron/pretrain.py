"""The training loop behind `examples/pretrain_gpt.py`: Megatron + the data service, one rank.

Rank 0 starts the service (embedded Ray by default, or joins `data.ray.address`) and
broadcasts how to reach it; every rank builds its `ClientPlaceTree` from Megatron's
`parallel_state`, a `Client`, its model chunks, and installs the schedule hooks, so
`get_forward_backward_func` is fed balanced microbatches step by step.

Checkpoints (``train.save`` every ``train.save_interval`` steps) hold, per rank, the model
chunks, the optimizer and the hooks' data position, and on rank 0 the Planner state before
the next step (``data_state.json``). ``train.load`` restores all of them; the data stream after
a resume is identical to an uninterrupted run, and an incompatible data config or parallel
layout is refused with a `ResumeError` naming the field.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale_data_ext.errors import ResumeError

CHECKPOINT_VERSION = 1


def serve(service_config: Any, tree: Any, *, state: dict | None, ray_kwargs: dict | None = None):
    """Start the service on rank 0 and tell every rank where it is. Returns (service|None, handles)."""
    service, payload = None, [None]
    if dist.get_rank() == 0:
        from megascale_data_ext.runtime.service import DataService

        service = DataService(service_config, tree)
        try:
            payload[0] = service.start(state=state, **(ray_kwargs or {}))
        except Exception as exc:  # every rank must learn about it, not hang in the broadcast
            payload[0] = exc
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
    payload[0].apply_env()
    return service, payload[0]


def _ckpt_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


def save_checkpoint(root: str | Path, step: int, chunks: list, optimizer: Any, hooks: Any, service: Any) -> Path:
    """Save model, optimizer and data state after `step` steps (the next step to run is `step`)."""
    path = _ckpt_dir(root, step)
    path.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    torch.save(
        {"version": CHECKPOINT_VERSION, "step": step, "model": [c.state_dict() for c in chunks],
         "optimizer": optimizer.state_dict(), "data": hooks.state_dict()},
        path / f"rank_{rank:05d}.pt",
    )
    if service is not None:
        (path / "data_state.json").write_text(json.dumps(service.state_dict(step)))
    dist.barrier()
    if rank == 0:
        (Path(root) / "latest").write_text(str(step))
    return path


def latest_step(root: str | Path) -> int:
    marker = Path(root) / "latest"
    if not marker.exists():
        raise ResumeError(f"no checkpoint in {root}: {marker} is missing (train.load must point at a train.save dir)")
    return int(marker.read_text())


def load_data_state(root: str | Path, step: int) -> dict:
    return json.loads((_ckpt_dir(root, step) / "data_state.json").read_text())


def load_checkpoint(root: str | Path, step: int, chunks: list, optimizer: Any, hooks: Any) -> None:
    path = _ckpt_dir(root, step) / f"rank_{dist.get_rank():05d}.pt"
    if not path.exists():
        raise ResumeError(f"{path} is missing: was the checkpoint written with another world size?")
    blob = torch.load(path, weights_only=False)
    if blob.get("version") != CHECKPOINT_VERSION:
        raise ResumeError(f"{path}: checkpoint version {blob.get('version')!r} != {CHECKPOINT_VERSION}")
    for chunk, sd in zip(chunks, blob["model"], strict=True):
        chunk.load_state_dict(sd)
    optimizer.load_state_dict(blob["optimizer"])
    hooks.load_state_dict(blob["data"])


def pretrain_gpt(cfg: Any) -> list[dict]:
    """Run `cfg.train.train_iters` steps of GPT pretraining on the service; returns this rank's step log."""
    from megatron.core import parallel_state

    from megascale_data_ext.config import load_config
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.megatron.hooks import install
    from megascale_data_ext.megatron.model import GPTModelConfig, build_model_chunks, initialize_parallel, train_step
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    data = load_config(cfg.data)
    service_cfg = data.to_service_config()
    par, mcfg, tcfg = cfg.parallel, cfg.model, cfg.train
    tp = int(par.tensor_model_parallel_size)
    vocab = load_tokenizer(service_cfg.sources[0].tokenizer).vocab_size
    model_cfg = GPTModelConfig(
        vocab_size=-(-vocab // (64 * tp)) * 64 * tp, hidden_size=int(mcfg.hidden_size), num_layers=int(mcfg.num_layers),
        num_attention_heads=int(mcfg.num_attention_heads), seq_length=service_cfg.seq_length, tp=tp,
        pp=int(par.pipeline_model_parallel_size), cp=int(par.get("context_parallel_size", 1)),
        vpp=par.get("virtual_pipeline_model_parallel_size"), seed=int(tcfg.get("seed", 1234)),
    )
    initialize_parallel(model_cfg)
    rank = dist.get_rank()
    tree = ClientPlaceTree.from_megatron()
    start = 0
    load_dir = tcfg.get("load")
    state = None
    if load_dir:
        start = latest_step(load_dir)
        state = load_data_state(load_dir, start) if rank == 0 else None
    service, handles = serve(service_cfg, tree, state=state, ray_kwargs=None)
    client = Client(tree, rank, namespace=handles.namespace, address=handles.address,
                    num_microbatches=service_cfg.num_microbatches, constructor_group=handles.constructor_group,
                    tp_group=parallel_state.get_tensor_model_parallel_group())
    chunks = build_model_chunks(model_cfg)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(tcfg.lr), weight_decay=0.0)
    hooks = install(client, num_model_chunks=len(chunks), start_step=start)
    if load_dir:
        load_checkpoint(load_dir, start, chunks, optimizer, hooks)
    planner = None
    if rank == 0:
        import ray

        planner = ray.get_actor("planner", namespace=handles.namespace)
    log: list[dict] = []
    save_dir, interval = tcfg.get("save"), int(tcfg.get("save_interval") or 0)
    try:
        for step in range(start, int(tcfg.train_iters)):
            t0 = time.perf_counter()
            n0, f0 = len(client.delivered), len(client.fetch_seconds)
            result = train_step(chunks, optimizer, None, num_microbatches=service_cfg.num_microbatches,
                                seq_length=service_cfg.seq_length)
            dt = time.perf_counter() - t0
            fetch = client.fetch_seconds[f0:]
            entry = {"step": step, "loss": result["loss"], "num_tokens": result["num_tokens"], "seconds": dt,
                     "digests": client.digests[n0:],
                     "samples": [np.asarray(i["samples"]).tolist() for i in client.delivered[n0:] if i is not None]}
            log.append(entry)
            if rank == 0:
                import ray

                s = ray.get(planner.plan_summary.remote(step))
                p50 = float(np.median(fetch)) * 1e3 if fetch else 0.0
                print(f"step {step:4d} | loss {result['loss']:.4f} | max/mean cost vanilla "
                      f"{s['vanilla_max_over_mean']:.3f} -> {s['max_over_mean']:.3f} | "
                      f"{result['num_tokens'] / dt:,.0f} loss-tokens/s | fetch p50 {p50:.1f} ms | {dt:.2f} s", flush=True)
            if save_dir and interval and (step + 1) % interval == 0:
                save_checkpoint(save_dir, step + 1, chunks, optimizer, hooks, service)
    except BaseException:
        # No barrier here: peers may be blocked in a collective; torchrun tears the job down.
        hooks.uninstall()
        if service is not None:
            service.stop()
        raise
    hooks.uninstall()
    dist.barrier()
    if service is not None:
        service.stop()
    return log
