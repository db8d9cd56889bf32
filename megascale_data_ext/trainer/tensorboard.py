"""Rank 0's TensorBoard scalars of a training run (``train.tensorboard_dir``, ``train.log_interval``).

Tags, one point per logged step:

    train/loss, train/lr, train/grad_norm, train/loss_tokens_per_s, train/step_seconds
    data/wait_ms                      time this rank waited on the service in the step
    balance/max_over_mean             the step's per-rank cost max/mean as balanced
    balance/vanilla_max_over_mean     the same samples split Megatron-style (vanilla)
    balance/measured_max_over_mean    max/mean of the ranks' measured compute seconds (`trainer.step.ComputeClock`)
    samples/<source>                  samples the step took from each source
    valid/loss, valid/ppl             each evaluation's loss on the held-out sources (``train.eval_interval``)

Needs the ``tensorboard`` package (``pip install megascale_data_ext[tensorboard]``); asking for
it without the package is a `ConfigError` naming the key. Single-threaded, rank 0 only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError


class ScalarLog:
    """Writes a step's scalars every `interval` steps to an event file in `directory`.

    Args:
        directory: The event files' directory (``train.tensorboard_dir``).
        interval: Steps between points (``train.log_interval``); step 0 is always logged.
        source_names: Names of the service's sources, in source-id order (``samples/<name>``).
    """

    def __init__(self, directory: str | Path, *, interval: int, source_names: Sequence[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError naming tensorboard when it is missing
            raise ConfigError(f"`train.tensorboard_dir`={str(directory)!r} needs the tensorboard package: "
                              "pip install 'megascale_data_ext[tensorboard]' (or set train.tensorboard_dir=null)") from e
        self.directory = Path(directory)
        self.interval = max(1, int(interval))
        self.source_names = list(source_names)
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def write(self, step: int, entry: Mapping[str, Any], summary: Mapping[str, Any] | None) -> None:
        """The step log `entry` (loss, lr, grad_norm, num_tokens, seconds, data_wait_ms) and the
        plan's `summary` (balance, per-source samples; None where this rank has no plan)."""
        w = self.writer
        seconds = float(entry.get("seconds") or 0.0)
        w.add_scalar("train/loss", float(entry["loss"]), step)
        for key in ("lr", "grad_norm"):
            if entry.get(key) is not None:
                w.add_scalar(f"train/{key}", float(entry[key]), step)
        if seconds > 0:
            w.add_scalar("train/loss_tokens_per_s", float(entry["num_tokens"]) / seconds, step)
            w.add_scalar("train/step_seconds", seconds, step)
        w.add_scalar("data/wait_ms", float(entry.get("data_wait_ms", 0.0)), step)
        if entry.get("measured_max_over_mean") is not None:
            w.add_scalar("balance/measured_max_over_mean", float(entry["measured_max_over_mean"]), step)
        if summary is not None:
            w.add_scalar("balance/max_over_mean", float(summary["max_over_mean"]), step)
            w.add_scalar("balance/vanilla_max_over_mean", float(summary["vanilla_max_over_mean"]), step)
            for name, count in zip(self.source_names, summary.get("per_source", []), strict=False):
                w.add_scalar(f"samples/{name}", float(count), step)
        w.flush()

    def write_valid(self, step: int, loss: float) -> None:
        """An evaluation's loss after `step` steps (every evaluation is logged)."""
        self.writer.add_scalar("valid/loss", float(loss), step)
        self.writer.add_scalar("valid/ppl", float(np.exp(min(float(loss), 20.0))), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
