"""Elastic resharding: resume a data stream under another parallel layout, exactly once.

The Planner's state before step s (cursors per source, mixer, loss reports) does not
depend on the layout: the layout only decides how step s's samples are split over buckets.
So a job that consumed steps < s under DP 4 can continue at step s under DP 2 (or another
TP/PP/CP), planning step s for the new `ClientPlaceTree` from the same cursors: every sample
a constructor had prefetched but no trainer consumed is planned again in the new layout
(its stream positions are past the saved cursors), none is skipped or delivered twice.

What may change is the layout (``world``) and, since Megatron's global batch is
DP x micro-batch x microbatches, ``num_microbatches``; anything that decides *which*
samples come (sources, seed, samples per step, sequence length, mixing...) must not, and is
refused by name. The trainer's position must be at a step boundary (`step_of_position`).
Plain Python: no Ray or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megascale_data_ext.errors import ResumeError
from megascale_data_ext.state import plain

__all__ = ["LAYOUT_KEYS", "reshard_planner_state", "step_of_position"]

LAYOUT_KEYS: tuple[str, ...] = ("world", "num_microbatches")
"""Planner fingerprint keys a resharded resume may change."""


def reshard_planner_state(state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """`state` (a `Planner.state_dict`) re-stamped for a planner whose fingerprint is `fingerprint`.

    Raises:
        ResumeError: the state is not a planner state, or a key outside `LAYOUT_KEYS` changed
            (each one named, saved vs now).
    """
    if not isinstance(state, Mapping) or state.get("kind") != "planner":
        raise ResumeError(f"elastic resume needs a planner state (DataService.state_dict()), got "
                          f"{type(state).__name__} of kind {getattr(state, 'get', lambda _k: None)('kind')!r}")
    saved, now = plain(dict(state.get("fingerprint") or {})), plain(dict(fingerprint))
    changed = [f"`{k}` (saved {saved.get(k)!r}, now {now.get(k)!r})" for k in sorted(set(saved) | set(now))
               if k not in LAYOUT_KEYS and saved.get(k) != now.get(k)]
    if changed:
        raise ResumeError("cannot reshard the planner state: only the parallel layout and num_microbatches may "
                          f"change on an elastic resume, but {', '.join(changed)} changed; resume with the data "
                          "config of the saved run")
    return {**dict(state), "fingerprint": {**saved, **{k: now[k] for k in LAYOUT_KEYS if k in now}}}


def step_of_position(position: Mapping[str, Any]) -> int:
    """The step a resharded job resumes at, from a saved `Client.state_dict` (data position).

    Raises:
        ResumeError: the position is inside a step (microbatch != 0): the old layout's
            microbatches of that step cannot be split over the new one; checkpoint after a step.
    """
    step, microbatch = int(position["step"]), int(position["microbatch"])
    if microbatch != 0:
        raise ResumeError(f"elastic resume at step {step}, microbatch {microbatch}: the data position must be at a "
                          "step boundary (save the checkpoint after a whole step) to change the layout")
    return step
