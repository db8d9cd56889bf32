"""PlannerRecovery: the Planner's way back after its process died (paper Sec. 6).

The Planner's state after every planned step goes to `PlannerCheckpoints`. A restarted Planner
loads the newest; a request for an older step (a constructor rebuilding what the dead process
had planned) rewinds to that step's saved state and re-plans it, which gives the same plan
(planning is deterministic). Loss reports (feedback mixing) are not part of the planner state a
step saves, so they are kept on disk beside it and handed back after every restore or rewind.

Plain class (no Ray): `runtime.actors.PlannerActor` is its façade; unit tests drive it directly.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from megascale_data_ext.errors import ResumeError
from megascale_data_ext.runtime.checkpoints import PlannerCheckpoints
from megascale_data_ext.runtime.elastic import reshard_planner_state
from megascale_data_ext.runtime.planner import Planner

__all__ = ["PlannerRecovery"]

_log = logging.getLogger(__name__)


class PlannerRecovery:
    """Checkpoint, restore, rewind and loss-report replay around one `Planner`; thread-safe as
    the Planner is (rewinds run under its planning lock).

    Args:
        planner: The Planner (fresh: nothing planned yet).
        checkpoints: Where states go; None: no recovery (plans older than the Planner's ``keep``
            cannot be served again).
        restarted: This process replaces one that died: restore the newest saved state.
        reports_kept: Steps of loss reports kept behind the newest one.
    """

    def __init__(self, planner: Planner, checkpoints: PlannerCheckpoints | None, *, restarted: bool,
                 reports_kept: int) -> None:
        self.planner, self.checkpoints, self.reports_kept = planner, checkpoints, reports_kept
        self.restored_from: int | None = None
        self.rewinds = 0
        self._reports: dict[int, list] = {}  # loss reports received, re-fed after every restore or rewind
        if checkpoints is None:
            return
        state = checkpoints.latest() if restarted else None
        if state is None:
            checkpoints.save(planner.state_dict())
            return
        self._reports = checkpoints.reports()
        self._load(state)
        self.restored_from = int(state["step"])
        _log.warning("planner restarted: restored its state before step %d", self.restored_from)

    def _load(self, state: dict) -> None:
        """Load a saved state, then hand back the loss reports it predates (feedback mixing)."""
        self.planner.load_state_dict(state)
        for step, pairs in sorted(self._reports.items()):
            self.planner.report_loss(step, dict(pairs))

    def plan(self, step: int) -> Any:
        """The plan of `step`: kept, planned now, or re-planned from the state saved before it."""
        try:
            return self.planner.plan(step)
        except ResumeError:
            if self.checkpoints is None:
                raise
        # Rewind under the planning lock: concurrent calls wait, and no other rewind moves the
        # Planner before `step` is planned (two concurrent rewinds used to clear each other's plan).
        with self.planner.planning():
            with contextlib.suppress(ResumeError):  # another rewind may have re-planned it meanwhile
                return self.planner.plan(step)
            state = self.checkpoints.at(step)
            if state is None:
                steps = self.checkpoints.steps()
                raise ResumeError(f"plan for step {step} is neither kept nor checkpointed (planner at step "
                                  f"{self.planner.next_step}, checkpoints of steps {steps[:1]}..{steps[-1:]}); "
                                  "raise data.fault_tolerance.checkpoint_keep")
            self._load(state)
            self.rewinds += 1
            return self.planner.plan(step)

    def planned(self) -> None:
        """Save the state right after a step was planned (call it under the planning lock, from the
        Planner's ``on_planned``); states no constructor can ask for again are pruned."""
        if self.checkpoints is not None:
            self.checkpoints.save(self.planner.state_dict(), keep_from=self.planner.low_water())

    def save_autoscaler(self, state: dict) -> None:
        """Save the AutoScaler's state beside the Planner's (a restarted Planner scales back to it)."""
        if self.checkpoints is not None:
            self.checkpoints.save_autoscaler(state)

    def state_dict(self, step: int | None = None) -> dict:
        """The state before `step` (default: the next unplanned one), from a checkpoint if the
        Planner has moved on."""
        try:
            return self.planner.state_dict(step)
        except ResumeError:
            state = self.checkpoints.at(step) if self.checkpoints is not None and step is not None else None
            if state is None:
                raise
            return state

    def load_state_dict(self, state: dict, *, reshard: bool = False) -> None:
        """Continue at the saved step; `reshard` accepts a state saved under another parallel layout.
        Earlier checkpoints (of another run) are dropped."""
        if reshard:
            state = reshard_planner_state(state, self.planner.fingerprint())
        self.planner.load_state_dict(state)
        if self.checkpoints is not None:
            self.checkpoints.clear()
            self.checkpoints.save(self.planner.state_dict())

    def report_loss(self, step: int, losses: dict) -> None:
        """Hand the Planner `step`'s per-source losses, and keep them for a restore or rewind."""
        self.planner.report_loss(step, losses)
        if self.checkpoints is not None and self.planner.report_delay is not None:
            self._reports[step] = [[k, v] for k, v in losses.items()]
            for old in [k for k in self._reports if k < step - self.reports_kept]:
                del self._reports[old]
            self.checkpoints.save_reports(self._reports)
