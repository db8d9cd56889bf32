"""Where a ``train.save`` directory keeps what: ``latest`` (the last step saved), and per step
``step_NNNNNNN/`` with each rank's ``rank_NNNNN.pt`` and rank 0's ``data_state.json``.

Without torch, so that rank 0 can read the data state before it imports torch
(`trainer.early_start`); `trainer.pretrain` writes and reads the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

from megascale_data_ext.errors import ResumeError


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after `step` steps."""
    return Path(root) / f"step_{step:07d}"


def latest_step(root: str | Path) -> int:
    """The step of the last complete checkpoint under `root` (ResumeError: none)."""
    marker = Path(root) / "latest"
    if not marker.exists():
        raise ResumeError(f"no checkpoint in {root}: {marker} is missing (train.load must point at a train.save dir)")
    return int(marker.read_text())


def load_data_state(root: str | Path, step: int) -> dict:
    """The Planner state saved with the checkpoint after `step` steps."""
    return json.loads((step_dir(root, step) / "data_state.json").read_text())
