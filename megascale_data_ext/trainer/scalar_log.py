"""Rank 0's scalars of a training run: TensorBoard (``train.tensorboard_dir``) and/or Weights &
Biases (``train.wandb_project``), every ``train.log_interval`` steps.

Tags, one point per logged step:

    train/loss, train/lr, train/grad_norm, train/loss_tokens_per_s, train/step_seconds
    data/wait_ms                      time this rank waited on the service in the step
    balance/max_over_mean             the step's per-rank cost max/mean as balanced
    balance/vanilla_max_over_mean     the same samples split Megatron-style (vanilla)
    balance/measured_max_over_mean    max/mean of the ranks' measured compute seconds (`trainer.step.ComputeClock`)
    samples/<source>                  samples the step took from each source
    valid/loss, valid/ppl             each evaluation's loss on the held-out sources (``train.eval_interval``)

TensorBoard needs the ``tensorboard`` package (``pip install megascale_data_ext[tensorboard]``),
W&B the ``wandb`` package (``[wandb]``; the run is ``wandb.init(project=train.wandb_project,
name=train.wandb_exp_name, dir=train.wandb_save_dir, config=<the composed config>)``, as
Megatron-LM's ``--wandb-*`` flags do; ``WANDB_MODE=offline`` works as usual). Asking for either
without its package is a `ConfigError` naming the key. Single-threaded, rank 0 only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WandbSettings:
    """Where a W&B run goes (Megatron-LM's ``--wandb-project/-exp-name/-save-dir``)."""

    project: str
    name: str | None = None
    save_dir: str | None = None
    config: Mapping[str, Any] | None = None


class _TensorBoard:
    def __init__(self, directory: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError naming tensorboard when it is missing
            raise ConfigError(f"`train.tensorboard_dir`={str(directory)!r} needs the tensorboard package: "
                              "pip install 'megascale_data_ext[tensorboard]' (or set train.tensorboard_dir=null)") from e
        self.writer = SummaryWriter(log_dir=str(directory))

    def add(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """One ``run.log`` per step: the step's scalars are gathered and logged together."""

    def __init__(self, settings: WandbSettings) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(f"`train.wandb_project`={settings.project!r} needs the wandb package: "
                              "pip install 'megascale_data_ext[wandb]' (or set train.wandb_project=null)") from e
        if settings.save_dir:
            Path(settings.save_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=settings.project, name=settings.name, dir=settings.save_dir,
                              config=dict(settings.config or {}))
        self.step: int | None = None
        self.pending: dict[str, float] = {}

    def add(self, tag: str, value: float, step: int) -> None:
        if step != self.step:
            self.flush()
            self.step = step
        self.pending[tag] = value

    def flush(self) -> None:
        if self.pending:
            self.run.log(self.pending, step=self.step)
            self.pending = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()


class ScalarLog:
    """Writes a step's scalars every `interval` steps to TensorBoard and/or W&B.

    Args:
        directory: TensorBoard's event files (``train.tensorboard_dir``); None: no TensorBoard.
        interval: Steps between points (``train.log_interval``); step 0 is always logged.
        source_names: Names of the service's sources, in source-id order (``samples/<name>``).
        wandb: The W&B run's settings (``train.wandb_*``); None: no W&B.
    """

    def __init__(self, directory: str | Path | None, *, interval: int, source_names: Sequence[str],
                 wandb: WandbSettings | None = None) -> None:
        self.directory = None if directory is None else Path(directory)
        self.interval = max(1, int(interval))
        self.source_names = list(source_names)
        self.sinks: list[Any] = []
        if self.directory is not None:
            self.sinks.append(_TensorBoard(self.directory))
        if wandb is not None:
            self.sinks.append(_Wandb(wandb))

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def _add(self, tag: str, value: float, step: int) -> None:
        for sink in self.sinks:
            sink.add(tag, float(value), step)

    def write(self, step: int, entry: Mapping[str, Any], summary: Mapping[str, Any] | None) -> None:
        """The step log `entry` (loss, lr, grad_norm, num_tokens, seconds, data_wait_ms) and the
        plan's `summary` (balance, per-source samples; None where this rank has no plan)."""
        seconds = float(entry.get("seconds") or 0.0)
        self._add("train/loss", entry["loss"], step)
        for key in ("lr", "grad_norm"):
            if entry.get(key) is not None:
                self._add(f"train/{key}", entry[key], step)
        if seconds > 0:
            self._add("train/loss_tokens_per_s", float(entry["num_tokens"]) / seconds, step)
            self._add("train/step_seconds", seconds, step)
        self._add("data/wait_ms", entry.get("data_wait_ms", 0.0), step)
        if entry.get("measured_max_over_mean") is not None:
            self._add("balance/measured_max_over_mean", entry["measured_max_over_mean"], step)
        if summary is not None:
            self._add("balance/max_over_mean", summary["max_over_mean"], step)
            self._add("balance/vanilla_max_over_mean", summary["vanilla_max_over_mean"], step)
            for name, count in zip(self.source_names, summary.get("per_source", []), strict=False):
                self._add(f"samples/{name}", count, step)
        self._flush()

    def write_valid(self, step: int, loss: float) -> None:
        """An evaluation's loss after `step` steps (every evaluation is logged)."""
        self._add("valid/loss", loss, step)
        self._add("valid/ppl", float(np.exp(min(float(loss), 20.0))), step)
        self._flush()

    def _flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
