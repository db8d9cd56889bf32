"""A training run's directory: the composed config, the overrides and the error logs.

Laid out like Hydra's output directory, so tools that read one read this::

    <train.run_dir>/
      .hydra/config.yaml      the composed config (as ``--cfg job`` prints it, interpolations kept)
      .hydra/overrides.yaml   the command-line overrides, a YAML list of strings
      error_rank<R>.log       the full traceback of a failed rank (its one ``error:`` line names it)

Checkpoints (``train.save``), step logs (``train.log_dir``) and TensorBoard events
(``train.tensorboard_dir``) go where those keys point, inside the run directory when they are
relative and ``train.run_dir`` is set. Without ``train.run_dir`` nothing is written here and
an error log goes to ``train.log_dir``, else to the temporary directory. No torch import.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN_KEYS = ("save", "log_dir", "tensorboard_dir", "wandb_save_dir")
"""``train`` keys holding output paths that a relative value takes from ``train.run_dir`` (not ``load``:
a resume reads another run's directory, named from the current directory)."""


def _train(cfg: Any) -> Any:
    return cfg.get("train") or {}


def run_dir(cfg: Any) -> Path | None:
    """``train.run_dir`` as an absolute path, or None when the run keeps no directory."""
    value = _train(cfg).get("run_dir")
    return Path(value).expanduser().resolve() if value else None


def resolve_run_paths(cfg: Any) -> None:
    """Put relative ``train.save``/``log_dir``/``tensorboard_dir``/``wandb_save_dir`` inside ``train.run_dir`` (in place)."""
    root = run_dir(cfg)
    train = _train(cfg)
    if root is None or not train:
        return
    for key in RUN_KEYS:
        value = train.get(key)
        if value and not Path(value).expanduser().is_absolute():
            train[key] = str(root / value)


def write_run_config(cfg: Any, overrides: Sequence[str]) -> Path | None:
    """Write ``.hydra/config.yaml`` and ``.hydra/overrides.yaml`` into the run directory (rank 0 only).

    Returns the run directory, or None when ``train.run_dir`` is not set or this is not rank 0.
    """
    from omegaconf import OmegaConf

    root = run_dir(cfg)
    if root is None or os.environ.get("RANK", "0") != "0":
        return None
    hydra = root / ".hydra"
    hydra.mkdir(parents=True, exist_ok=True)
    (hydra / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (hydra / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return root


def error_log_path(cfg: Any) -> Path:
    """Where this rank's full error log goes: the run directory, ``train.log_dir`` or the temp dir."""
    rank = os.environ.get("RANK", "0")
    root = run_dir(cfg)
    if root is None:
        log_dir = _train(cfg).get("log_dir")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getppid()}"  # the same on every rank
        root = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "megascale-data" / run_id
    return root.expanduser().resolve() / f"error_rank{rank}.log"


def write_error_log(path: Path, exc: BaseException) -> Path | None:
    """The exception's whole chain (remote tracebacks included) at `path`; None if it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path
