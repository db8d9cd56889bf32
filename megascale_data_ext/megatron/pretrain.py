"""The training loop behind `examples/pretrain_gpt.py`: Megatron + the data service, one rank.

Rank 0 starts the service (embedded Ray by default, or joins `data.ray.address`) and
broadcasts how to reach it; every rank builds its `ClientPlaceTree` from Megatron's
`parallel_state`, a `Client`, its model chunks, and installs the schedule hooks, so
`get_forward_backward_func` is fed balanced microbatches step by step.

Checkpoints (``train.save`` every ``train.save_interval`` steps) hold, per rank, the model
chunks, the optimizer and the client's data position, and on rank 0 the Planner state before
the next step (``data_state.json``). ``train.load`` restores all of them; the data stream after
a resume is identical to an uninterrupted run, and an incompatible data config or parallel
layout is refused with a `ResumeError` naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale_data_ext.errors import ResumeError

CHECKPOINT_VERSION = 1


def serve(service_config: Any, tree: Any, *, state: dict | None):
    """Start the service on rank 0 and tell every rank where it is. Returns (service|None, handles)."""
    service, payload = None, [None]
    if dist.get_rank() == 0:
        from megascale_data_ext.runtime.service import DataService

        service = DataService(service_config, tree)
        try:
            payload[0] = service.start(state=state)
        except Exception as exc:  # every rank must learn about it, not hang in the broadcast
            payload[0] = exc
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
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


def gpt_model_config(cfg: Any, service_cfg: Any, vocab: int) -> Any:
    """The backbone's `GPTModelConfig` from the run config (`model`, `parallel`, `train` nodes)."""
    from megascale_data_ext.megatron.model import GPTModelConfig

    par, mcfg = cfg.parallel, cfg.model
    tp = int(par.tensor_model_parallel_size)
    return GPTModelConfig(
        vocab_size=-(-vocab // (64 * tp)) * 64 * tp, hidden_size=int(mcfg.hidden_size), num_layers=int(mcfg.num_layers),
        num_attention_heads=int(mcfg.num_attention_heads), seq_length=service_cfg.seq_length, tp=tp,
        pp=int(par.pipeline_model_parallel_size), cp=int(par.get("context_parallel_size", 1)),
        vpp=par.get("virtual_pipeline_model_parallel_size"), seed=int(cfg.train.get("seed", 1234)),
    )


class TrainingSession:
    """What every pretrain loop shares: parallel state, the service, the client, hooks, checkpoints.

    `__init__` initialises gloo/NCCL + Megatron's parallel state, builds the `ClientPlaceTree`,
    starts (rank 0) or joins the service — from the checkpoint's data state when
    ``train.load`` is set — and creates the rank's `Client`. `run()` installs the schedule
    hooks and drives the steps; loop-specific work goes in its callbacks.
    """

    def __init__(self, cfg: Any, service_cfg: Any, model_cfg: Any) -> None:
        from megascale_data_ext.dataplane.placetree import ClientPlaceTree
        from megascale_data_ext.megatron.groups import broadcast_group
        from megascale_data_ext.megatron.model import initialize_parallel
        from megascale_data_ext.runtime.client import Client
        from megascale_data_ext.runtime.topology import PLANNER_NAME

        self.cfg, self.service_cfg = cfg, service_cfg
        initialize_parallel(model_cfg)
        self.rank = dist.get_rank()
        self.tree = ClientPlaceTree.from_megatron()
        self.load_dir = cfg.train.get("load")
        self.start, state = 0, None
        if self.load_dir:
            self.start = latest_step(self.load_dir)
            state = load_data_state(self.load_dir, self.start) if self.rank == 0 else None
        self.service, self.handles = serve(service_cfg, self.tree, state=state)
        self.client = Client.connect(self.handles, self.rank, num_microbatches=service_cfg.num_microbatches,
                                     broadcast_group=broadcast_group(self.handles.topology),
                                     record_digests=bool(cfg.train.get("record_digests", False)))
        self.planner = None
        if self.rank == 0:
            import ray

            self.planner = ray.get_actor(PLANNER_NAME, namespace=self.handles.namespace)

    def plan(self, step: int) -> Any:
        """The step's StepPlan (rank 0 only: it holds the planner handle)."""
        import ray

        return ray.get(self.planner.plan.remote(step))

    def run(
        self,
        chunks: list,
        optimizer: Any,
        *,
        transform: Callable[[Any, Any], Any] | None = None,
        before_step: Callable[[int], dict] | None = None,
        report: Callable[[int, dict], None] | None = None,
    ) -> list[dict]:
        """Train until ``train.train_iters``; returns this rank's step log.

        Args:
            transform: Per-microbatch ``(batch, info) -> batch`` the hooks apply (e.g. `VLMFeed`).
            before_step: Per-step work before the schedule runs; its dict joins the log entry.
            report: Rank 0's per-step printout (default: loss, balance, tokens/s, fetch latency).
        """
        from megascale_data_ext.megatron.hooks import install
        from megascale_data_ext.megatron.model import train_step

        client, tcfg, m = self.client, self.cfg.train, self.service_cfg.num_microbatches
        hooks = install(client, num_model_chunks=len(chunks), start_step=self.start, transform=transform,
                        report_loss=self.service_cfg.feedback_mixing)
        if self.load_dir:
            load_checkpoint(self.load_dir, self.start, chunks, optimizer, hooks)
        log: list[dict] = []
        save_dir, interval = tcfg.get("save"), int(tcfg.get("save_interval") or 0)
        try:
            for step in range(self.start, int(tcfg.train_iters)):
                t0 = time.perf_counter()
                client.drain()
                extra = before_step(step) if before_step is not None else {}
                result = train_step(chunks, optimizer, None, num_microbatches=m, seq_length=self.service_cfg.seq_length)
                dt = time.perf_counter() - t0
                records = client.drain()
                fetch = records["fetch_seconds"]
                entry = {"step": step, "loss": result["loss"], "num_tokens": result["num_tokens"], "seconds": dt,
                         "fetch_p50_ms": float(np.median(fetch)) * 1e3 if fetch else 0.0,
                         "data_wait_ms": float(np.sum(fetch)) * 1e3,  # time this rank waited on the service
                         "digests": records["digests"],
                         "samples": [np.asarray(i["samples"]).tolist() for i in records["delivered"] if i is not None],
                         **extra}
                if self.rank == 0:
                    (report or self._report)(step, entry)
                log.append(entry)
                if save_dir and interval and (step + 1) % interval == 0:
                    save_checkpoint(save_dir, step + 1, chunks, optimizer, hooks, self.service)
        except BaseException:
            hooks.uninstall()  # no barrier: peers may be blocked in a collective; torchrun tears the job down
            self._stop()
            raise
        hooks.uninstall()
        dist.barrier()
        self._stop()
        return log

    def _report(self, step: int, entry: dict) -> None:
        s = self.plan(step).summary()
        print(f"step {step:4d} | loss {entry['loss']:.4f} | max/mean cost vanilla {s['vanilla_max_over_mean']:.3f} -> "
              f"{s['max_over_mean']:.3f} | {entry['num_tokens'] / entry['seconds']:,.0f} loss-tokens/s | "
              f"data wait {entry['data_wait_ms']:.1f} ms | {entry['seconds']:.2f} s", flush=True)

    def _stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


def pretrain_gpt(cfg: Any) -> list[dict]:
    """Run `cfg.train.train_iters` steps of GPT pretraining on the service; returns this rank's step log."""
    from megascale_data_ext.config import load_config
    from megascale_data_ext.megatron.model import build_model_chunks
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    cp = int(cfg.parallel.get("context_parallel_size", 1))
    service_cfg = load_config(cfg.data, context_parallel_size=cp).to_service_config()
    vocab = load_tokenizer(service_cfg.sources[0].tokenizer).vocab_size
    model_cfg = gpt_model_config(cfg, service_cfg, vocab)
    session = TrainingSession(cfg, service_cfg, model_cfg)
    chunks = build_model_chunks(model_cfg)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(cfg.train.lr), weight_decay=0.0)
    return session.run(chunks, optimizer)
