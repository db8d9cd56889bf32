"""The training loop behind `examples/pretrain_gpt.py`: Megatron + the data service, one rank.

Rank 0 starts the service (embedded Ray by default, or joins `data.ray.address`) and
broadcasts how to reach it; every rank builds its `ClientPlaceTree` from Megatron's
`parallel_state`, a `Client`, its model chunks, and installs the schedule hooks, so
`get_forward_backward_func` is fed balanced microbatches step by step.

The optimizer recipe is `trainer.optimizer.build_optimizer`'s: AdamW, linear warm-up (``train.lr_warmup_iters``),
cosine decay to ``train.min_lr`` over ``train.lr_decay_iters`` (default ``train_iters``), global
grad-norm clipping (``train.clip_grad``); ``train.bf16`` trains in Megatron's bf16 mixed precision
(fp32 master weights here). Model and batches live on ``cuda:LOCAL_RANK`` when CUDA is present.

Checkpoints (``train.save`` every ``train.save_interval`` steps) hold, per rank, the model
chunks, the optimizer, the LR schedule and the client's data position, and on rank 0 the Planner state before
the next step (``data_state.json``). ``train.load`` restores all of them; the data stream after
a resume is identical to an uninterrupted run, and an incompatible data config or parallel
layout is refused with a `ResumeError` naming the field.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale_data_ext.errors import ConfigError, ResumeError, root_cause
from megascale_data_ext.trainer.checkpoint_dir import latest_step, load_data_state, step_dir
from megascale_data_ext.trainer import early_start

CHECKPOINT_VERSION = 1


def begin_serve(service_config: Any, tree: Any, *, state: dict | None, label: str = "") -> tuple[Any, Any]:
    """Rank 0 starts the service in the background (the model is built meanwhile): ``(service,
    future | exception)``; ``(None, None)`` on the other ranks. `finish_serve` completes it.
    `label` prefixes its start-up progress lines (the validation service's beside the training one's)."""
    if dist.get_rank() != 0:
        return None, None
    from megascale_data_ext.runtime.service import DataService, print_progress

    launched = early_start.take(label, service_config, tree, state)  # asked for before torch was imported
    if launched is not None:
        return launched

    service = DataService(service_config, tree, progress=(lambda line: print_progress(label + line)) if label
                          else print_progress)
    try:
        return service, service.start_in_background(state=state)
    except Exception as exc:  # Ray could not start: every rank learns it in finish_serve
        return service, exc


def finish_serve(pending: Any) -> tuple[Any, float]:
    """Wait for rank 0's service and tell every rank where it is: ``(handles, waited_s)``, the
    seconds this rank waited for it after its own start-up work."""
    t0, payload, failure = time.perf_counter(), [None], None
    if dist.get_rank() == 0:
        try:
            if isinstance(pending, Exception):
                raise pending
            payload[0] = pending.result()
        except Exception as exc:  # every rank must learn about it, not hang in the broadcast
            # Ray's wrapper of an actor's error does not pickle and repeats the remote traceback
            # in its message: the other ranks get the actor's own error, rank 0 keeps the chain.
            failure, payload[0] = exc, root_cause(exc)
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        if failure is not None and payload[0] is not failure:
            raise payload[0] from failure
        raise payload[0]
    return payload[0], time.perf_counter() - t0


def save_checkpoint(root: str | Path, step: int, chunks: list, optimizer: Any, hooks: Any, service: Any,
                    scheduler: Any = None) -> Path:
    """Save model, optimizer, LR schedule and data state after `step` steps (the next step to run is `step`)."""
    path = step_dir(root, step)
    path.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    torch.save(
        {"version": CHECKPOINT_VERSION, "step": step, "model": [c.state_dict() for c in chunks],
         "optimizer": optimizer.state_dict(), "data": hooks.state_dict(),
         "scheduler": None if scheduler is None else scheduler.state_dict()},
        path / f"rank_{rank:05d}.pt",
    )
    if service is not None:
        (path / "data_state.json").write_text(json.dumps(service.state_dict(step)))
    dist.barrier()
    if rank == 0:
        (Path(root) / "latest").write_text(str(step))
    return path


def load_checkpoint(root: str | Path, step: int, chunks: list, optimizer: Any, hooks: Any,
                    scheduler: Any = None) -> None:
    path = step_dir(root, step) / f"rank_{dist.get_rank():05d}.pt"
    if not path.exists():
        raise ResumeError(f"{path} is missing: was the checkpoint written with another world size?")
    blob = torch.load(path, weights_only=False)
    if blob.get("version") != CHECKPOINT_VERSION:
        raise ResumeError(f"{path}: checkpoint version {blob.get('version')!r} != {CHECKPOINT_VERSION}")
    for chunk, sd in zip(chunks, blob["model"], strict=True):
        chunk.load_state_dict(sd)
    optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob.get("scheduler") is not None:
        scheduler.load_state_dict(blob["scheduler"])
    hooks.load_state_dict(blob["data"])


def _own_samples(delivered: list) -> list:
    """The samples of this rank's delivered microbatches, a hybrid-CP group's only on its first
    member (every member holds a slice of the same documents), so each sample is logged once."""
    return [np.asarray(i["samples"]).tolist() for i in delivered if i is not None and not i.get("rank_in_group", 0)]


def gpt_model_config(cfg: Any, service_cfg: Any, vocab: int) -> Any:
    """The backbone's `GPTModelConfig` from the run config (`model`, `parallel`, `train` nodes)."""
    from megascale_data_ext.trainer.model import GPTModelConfig

    par, mcfg = cfg.parallel, cfg.model
    tp = int(par.tensor_model_parallel_size)
    hybrid = service_cfg.strategy == "hybrid_cp"  # every document its own CP group: set up on the model side too
    if hybrid:
        problems = [f"train.per_token_loss=true (ranks run different numbers of microbatches; got "
                    f"{cfg.train.get('per_token_loss', False)!r})"] if not cfg.train.get("per_token_loss", False) else []
        if par.get("virtual_pipeline_model_parallel_size") is not None:
            problems.append("parallel.virtual_pipeline_model_parallel_size=null (the interleaved schedule orders a "
                            "rank's microbatches by its count across model chunks; only 1F1B is aligned for)")
        if int(par.pipeline_model_parallel_size) > 2 and not getattr(service_cfg, "middle_stage_masks", True):
            problems.append("data.middle_stage_masks=true (a middle pipeline stage needs each microbatch's group "
                            "and document boundaries)")
        if problems:
            raise ConfigError("data.strategy=hybrid_cp needs " + "; and ".join(problems))
    return GPTModelConfig(
        vocab_size=-(-vocab // (64 * tp)) * 64 * tp, hidden_size=int(mcfg.hidden_size), num_layers=int(mcfg.num_layers),
        num_attention_heads=int(mcfg.num_attention_heads), seq_length=service_cfg.seq_length, tp=tp,
        pp=int(par.pipeline_model_parallel_size), cp=int(par.get("context_parallel_size", 1)),
        vpp=par.get("virtual_pipeline_model_parallel_size"), seed=int(cfg.train.get("seed", 1234)),
        attention=str(mcfg.get("attention", "auto")), bf16=bool(cfg.train.get("bf16", False)),
        per_token_loss=bool(cfg.train.get("per_token_loss", False)), hybrid_cp=hybrid,
    )


class TrainingSession:
    """What every pretrain loop shares: parallel state, the service, the client, hooks, checkpoints.

    `__init__` initialises gloo/NCCL + Megatron's parallel state, builds the `ClientPlaceTree`
    and has rank 0 start the service in the background — from the checkpoint's data state when
    ``train.load`` is set; `connect()` (after the model is built, so the service's start-up is
    hidden behind it) waits for it and creates the rank's `Client`. `run()` installs the
    schedule hooks and drives the steps; loop-specific work goes in its callbacks.
    """

    def __init__(self, cfg: Any, service_cfg: Any, model_cfg: Any, valid_cfg: Any = None) -> None:
        from megascale_data_ext.dataplane.placetree import ClientPlaceTree
        from megascale_data_ext.trainer.model import initialize_parallel, settle_model_environ

        self.cfg, self.service_cfg = cfg, service_cfg
        self.eval_interval = int(cfg.train.get("eval_interval") or 0)
        self.eval_iters = int(cfg.train.get("eval_iters") or 1)
        if self.eval_interval > 0 and valid_cfg is None:
            raise ConfigError(f"`train.eval_interval`={self.eval_interval} needs held-out sources: list them under "
                              "`data.validation.sources`, or set train.eval_interval=0")
        self.valid_cfg = valid_cfg if self.eval_interval > 0 else None
        initialize_parallel(model_cfg)
        self.rank = dist.get_rank()
        self.tree = ClientPlaceTree.from_megatron()
        self.load_dir = cfg.train.get("load")
        self.start, state = 0, None
        if self.load_dir:
            self.start = latest_step(self.load_dir)
            state = load_data_state(self.load_dir, self.start) if self.rank == 0 else None
        settle_model_environ(model_cfg)  # before the service's start-up thread: the model build then adds no variable
        self.service, self._pending = begin_serve(service_cfg, self.tree, state=state)
        # The validation service (held-out sources, its own namespace) starts beside it, on the same Ray.
        self.valid_service, self._valid_pending = (None, None) if self.valid_cfg is None else begin_serve(
            self.valid_cfg, self.tree, state=None, label=early_start.VALIDATION_LABEL)
        # when rank 0 asked for the actors: before torch was imported (`trainer.early_start`), or now
        self.started = getattr(self.service, "asked_at", None) or time.perf_counter()
        self.client = self.valid_client = self.planner = self.handles = None
        self._fit_from: int | None = None  # the first step the Planner balanced with the online fit
        if state is not None and state.get("cost_model") is not None:
            self._fit_from = self.start  # the resumed Planner goes on with the fit it had adopted
        self._said_not_yet = False
        self._summary: tuple[int, dict] | None = None

    def connect(self) -> Any:
        """This rank's `Client`, once the service rank 0 started in the background is up (call it
        after building the model: the service's start-up runs behind that). Says on rank 0 how
        much of the start-up the trainer still waited for."""
        if self.client is not None:
            return self.client
        from megascale_data_ext.megatron.groups import broadcast_group
        from megascale_data_ext.runtime.client import Client

        self.handles, waited = finish_serve(self._pending)
        self._pending = None
        digests = bool(self.cfg.train.get("record_digests", False))
        self.client = Client.connect(self.handles, self.rank, num_microbatches=self.service_cfg.num_microbatches,
                                     broadcast_group=broadcast_group(self.handles.topology), record_digests=digests)
        if self.valid_cfg is not None:
            valid_handles, valid_waited = finish_serve(self._valid_pending)
            self._valid_pending, waited = None, waited + valid_waited
            self.valid_client = Client.connect(valid_handles, self.rank, num_microbatches=self.valid_cfg.num_microbatches,
                                               broadcast_group=broadcast_group(valid_handles.topology),
                                               record_digests=digests)
            # Megatron's position of the validation stream: every evaluation so far took eval_iters steps.
            self.valid_client.seek((self.start // self.eval_interval) * self.eval_iters)
        if self.rank == 0:
            from megascale_data_ext.runtime.remote import find_planner

            self.planner = find_planner(self.handles.namespace)
            svc = self.service
            own = time.perf_counter() - self.started - waited
            print(f"[megascale-data] start-up: Ray {svc.ray_init_seconds:.2f} s, then the service's actors "
                  f"({svc.startup_seconds - svc.ray_init_seconds:.2f} s) beside {own:.2f} s of the trainer's own start-up "
                  f"({'imports, ' if svc.launched_early else ''}model construction): the trainer waited {waited:.2f} s "
                  "for the service", flush=True)
        return self.client

    def plan(self, step: int) -> Any:
        """The step's StepPlan (rank 0 only: it holds the planner handle)."""
        import ray

        return ray.get(self.planner.plan.remote(step))

    def step_summary(self, step: int) -> dict:
        """The step plan's summary (balance, per-source samples), asked of the Planner once per step:
        the summary, not the whole plan (every sample's rows) that `plan` sends."""
        import ray

        if self._summary is None or self._summary[0] != step:
            self._summary = (step, ray.get(self.planner.plan_summary.remote(step)))
        return self._summary[1]

    def _scalar_log(self) -> Any:
        """Rank 0's scalar log when ``train.tensorboard_dir`` or ``train.wandb_project`` is set, else None."""
        tcfg = self.cfg.train
        directory, project = tcfg.get("tensorboard_dir"), tcfg.get("wandb_project")
        if self.rank != 0 or not (directory or project):
            return None
        from omegaconf import OmegaConf

        from megascale_data_ext.trainer.scalar_log import ScalarLog, WandbSettings

        wandb = None if not project else WandbSettings(
            project=str(project), name=tcfg.get("wandb_exp_name"), save_dir=tcfg.get("wandb_save_dir"),
            config=OmegaConf.to_container(self.cfg, resolve=True) if OmegaConf.is_config(self.cfg) else None)
        return ScalarLog(directory or None, interval=int(tcfg.get("log_interval") or 1),
                         source_names=[s.name for s in self.service_cfg.sources], wandb=wandb)

    def run(
        self,
        chunks: list,
        optimizer: Any,
        *,
        scheduler: Any = None,
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
        from megascale_data_ext.trainer.step import ComputeClock, train_step

        client, tcfg, m = self.connect(), self.cfg.train, self.service_cfg.num_microbatches
        hooks = install(client, num_model_chunks=len(chunks), start_step=self.start, transform=transform,
                        report_loss=self.service_cfg.feedback_mixing, valid_client=self.valid_client)
        if self.load_dir:
            load_checkpoint(self.load_dir, self.start, chunks, optimizer, hooks, scheduler)
        log: list[dict] = []
        save_dir, interval = tcfg.get("save"), int(tcfg.get("save_interval") or 0)
        calibration = self._step_calibration()
        adopt_after = int(tcfg.get("adopt_calibration_after") or 0)
        scalars = self._scalar_log()
        clock = ComputeClock(chunks)
        try:
            for step in range(self.start, int(tcfg.train_iters)):
                t0 = time.perf_counter()
                clock.start()
                client.drain()
                if calibration is not None:
                    calibration.request(step)
                extra = before_step(step) if before_step is not None else {}
                result = train_step(chunks, optimizer, None, num_microbatches=m, seq_length=self.service_cfg.seq_length,
                                    clip_grad=float(tcfg.get("clip_grad", 0.0) or 0.0), scheduler=scheduler)
                dt = time.perf_counter() - t0
                computed = clock.gather()  # every rank's seconds to its gradient reduction
                if calibration is not None:
                    calibration.observe(step, dt)
                    if adopt_after and self._fit_from is None and calibration.online.steps >= adopt_after:
                        self._fit_from = self._adopt(calibration)
                records = client.drain()
                fetch = records["fetch_seconds"]
                entry = {"step": step, "loss": result["loss"], "num_tokens": result["num_tokens"], "seconds": dt,
                         "lr": result["lr"], "grad_norm": result["grad_norm"],
                         "fetch_p50_ms": float(np.median(fetch)) * 1e3 if fetch else 0.0,
                         "data_wait_ms": float(np.sum(fetch)) * 1e3,  # time this rank waited on the service
                         "data_bytes": records["bytes"],  # what it received from the service (encoder share too)
                         "patch_bytes": records["patch_bytes"],  # of which image patches
                         "constructor_lead": max((i.get("lead") or 0 for i in records["delivered"] if i is not None),
                                                 default=None),  # steps its constructor holds ahead of the slowest
                         "digests": records["digests"],
                         "samples": _own_samples(records["delivered"]),
                         "compute_s": computed,
                         "measured_max_over_mean": max(computed) / max(float(np.mean(computed)), 1e-12),
                         **extra}
                if self.rank == 0:
                    (report or self._report)(step, entry)
                if scalars is not None and scalars.due(step):
                    scalars.write(step, entry, self.step_summary(step))
                log.append(entry)
                if save_dir and interval and (step + 1) % interval == 0:
                    save_checkpoint(save_dir, step + 1, chunks, optimizer, hooks, self.service, scheduler)
                if self.eval_interval and ((step + 1) % self.eval_interval == 0 or step + 1 == int(tcfg.train_iters)):
                    entry["valid"] = self.evaluate(chunks, step + 1)
                    if scalars is not None:
                        scalars.write_valid(step + 1, entry["valid"]["loss"])
        except BaseException as exc:
            hooks.uninstall()  # no barrier: peers may be blocked in a collective; torchrun tears the job down
            if self.service is not None:  # said before the service stops (`app.report_error`)
                from megascale_data_ext.trainer.app import report_error
                from megascale_data_ext.trainer.run_dir import error_log_path

                report_error(exc, error_log_path(self.cfg))
            self._stop()
            raise
        finally:
            clock.close()
            if scalars is not None:
                scalars.close()
        hooks.uninstall()
        if calibration is not None:
            print(calibration.report(), flush=True)
            out = save_dir or tcfg.get("log_dir")
            if out:
                calibration.save(out)
        dist.barrier()
        self._stop()
        return log

    def evaluate(self, chunks: list, after: int) -> dict:
        """``train.eval_iters`` forward-only steps of the validation service (the hooks feed them),
        after `after` training steps: token-weighted loss over them, the validation steps used and
        the samples this rank was delivered; rank 0 prints one line."""
        from megascale_data_ext.trainer.step import eval_step

        client, t0 = self.valid_client, time.perf_counter()
        first, loss_sum, tokens = client.step, 0.0, 0.0
        client.drain()
        for _ in range(self.eval_iters):
            result = eval_step(chunks, num_microbatches=self.valid_cfg.num_microbatches,
                               seq_length=self.valid_cfg.seq_length)
            loss_sum += result["loss"] * result["num_tokens"]
            tokens += result["num_tokens"]
        records = client.drain()
        loss = loss_sum / max(tokens, 1.0)
        out = {"loss": loss, "num_tokens": tokens, "steps": [first, client.step], "digests": records["digests"],
               "samples": [np.asarray(i["samples"]).tolist() for i in records["delivered"] if i is not None]}
        if self.rank == 0:
            print(f"validation after {after} steps | loss {loss:.4f} | ppl {math.exp(min(loss, 20.0)):.2f} | "
                  f"validation steps {first}..{client.step - 1} | {tokens:,.0f} loss-tokens | "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)
        return out

    def _step_calibration(self) -> Any:
        """Rank 0's online cost-model fit from step times (needs the service this rank started)."""
        if self.service is None:
            return None
        import ray

        from megascale_data_ext.trainer.step_calibration import StepCalibration

        planner = self.service.planner

        def plan_of(step: int) -> Any:  # the round trip starts now, ray.get when the step is done
            ref = planner.plan.remote(step)
            return lambda: ray.get(ref)

        return StepCalibration(plan_of, self.service_cfg.strategy_args)

    def _adopt(self, calibration: Any) -> int | None:
        """Hand the Planner the online fit (``train.adopt_calibration_after``): the first step it
        balances with it; None while the fit has no per-token term (it would cost every document
        alike, and balancing needs their differences), asked again after the next step."""
        import ray

        model = calibration.online.model()
        if model.linear <= 0 and model.quadratic <= 0:
            if not self._said_not_yet:
                print(f"[calibration] not adopting the online fit of {calibration.online.steps} steps yet: it has no "
                      "per-token term (every document would cost the same); trying again after each step", flush=True)
                self._said_not_yet = True
            return None
        first = ray.get(self.service.planner.adopt_cost_model.remote(model.to_dict()))
        print(f"[calibration] the Planner balances steps {first}+ with the online fit of {calibration.online.steps} "
              f"steps (fixed {model.fixed * 1e3:.2f} ms/microbatch, linear {model.linear * 1e6:.3f} us/token, "
              f"quadratic {model.quadratic * 1e9:.4f} ns/token^2) instead of {self.service_cfg.strategy_args.get('model')}",
              flush=True)
        return first

    def _report(self, step: int, entry: dict) -> None:
        s = self.step_summary(step)
        basis = " (fit)" if self._fit_from is not None and step >= self._fit_from else ""
        print(f"step {step:4d} | loss {entry['loss']:.4f} | {step_counts(s, self.service_cfg)} | max/mean cost "
              f"vanilla {s['vanilla_max_over_mean']:.3f} -> planned {s['max_over_mean']:.3f}{basis}, measured "
              f"{entry['measured_max_over_mean']:.3f} | lr {entry['lr']:.2e} | "
              f"grad norm {entry['grad_norm']:.2f} | {entry['num_tokens'] / entry['seconds']:,.0f} loss-tokens/s | "
              f"data wait {entry['data_wait_ms']:.1f} ms{_lead(entry)} | {entry['seconds']:.2f} s", flush=True)

    def _stop(self) -> None:
        if self.valid_service is not None:  # first: the training service may own Ray
            self.valid_service.stop()
            self.valid_service = None
        if self.service is not None:
            self.service.stop()
            self.service = None


def step_counts(summary: dict, service_cfg: Any) -> str:
    """``samples N (deferred D) per source [a, b, ...]`` of a step's plan summary; deferred counts the
    mixed samples a samples-per-step plan pushed to later steps because they did not fit."""
    want = getattr(service_cfg, "samples_per_step", None)
    deferred = max(0, int(want) - int(summary["samples"])) if want and not getattr(
        service_cfg, "tokens_per_step", None) else 0
    return f"samples {summary['samples']} (deferred {deferred}) per source {list(summary.get('per_source', []))}"


def pretrain_gpt(cfg: Any) -> list[dict]:
    """Run `cfg.train.train_iters` steps of GPT pretraining on the service; returns this rank's step log."""
    from megascale_data_ext.config import load_config
    from megascale_data_ext.trainer.model import build_model_chunks
    from megascale_data_ext.trainer.optimizer import build_optimizer
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    cp = int(cfg.parallel.get("context_parallel_size", 1))
    data = load_config(cfg, context_parallel_size=cp)  # its `model` gives the cost model
    service_cfg = data.to_service_config()
    vocab = load_tokenizer(service_cfg.sources[0].tokenizer).vocab_size
    model_cfg = gpt_model_config(cfg, service_cfg, vocab)
    session = TrainingSession(cfg, service_cfg, model_cfg, data.validation_service_config())
    chunks = build_model_chunks(model_cfg)
    optimizer, scheduler = build_optimizer(chunks, cfg.train, bf16=model_cfg.bf16)
    return session.run(chunks, optimizer, scheduler=scheduler)


def _lead(entry: dict) -> str:
    """`` (lead N)``: steps rank 0's constructor held ahead of its slowest fetching rank (a fast
    rank waits there at data.fault_tolerance.max_lead_steps); empty on ranks that do not fetch."""
    lead = entry.get("constructor_lead")
    return "" if lead is None else f" (constructor lead {lead})"
