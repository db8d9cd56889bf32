"""On-disk states a restarted Planner recovers from, one per planned step.

The Planner's state is small (cursors + mixer, `Planner.state_dict`), and the service is
deterministic given (config, planner state before step s): a restarted Planner loads the
state before the oldest step a constructor may still ask for and re-plans identical plans.
It is therefore written after *every* planned step, one JSON file per step
(``planner-<step>.json``, written to a temporary name and renamed, so a kill mid-write
leaves the previous files intact), keeping the newest ``keep``. The fingerprint, the same for
every step of a run and most of a state at 1,000+ sources, is written once beside them
(``fingerprint.json``) and named from each step's file.

Loaders need no state of their own: what they hand out is a pure function of the plan (seed,
epoch, position), so a restarted loader reads any step again from its plan.
Plain Python: no Ray or torch.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from megascale_data_ext.errors import ResumeError

__all__ = ["PlannerCheckpoints", "write_atomic"]

_PLANNER = re.compile(r"^planner-(\d{10})\.json$")
FINGERPRINT = "fingerprint.json"
"""Where a run's step states keep their shared fingerprint (each names it instead of a copy)."""


def write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON to `path` through a temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:  # pruned meanwhile
        return None
    except json.JSONDecodeError as exc:
        raise ResumeError(f"checkpoint {path} is not valid JSON ({exc}); delete it so the previous one "
                          "is used") from exc


class PlannerCheckpoints:
    """The Planner's state before each recent step, one file per step in `directory`.

    Args:
        directory: Created if missing; a service's own (two services must not share one).
        keep: Newest states kept; older files are deleted as new ones are written.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 32) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._lock = threading.Lock()
        self._fingerprint: Any = None  # the fingerprint last written to FINGERPRINT
        self._written: set[int] | None = None  # steps whose files exist (the directory is this service's)

    def path(self, step: int) -> Path:
        return self.directory / f"planner-{step:010d}.json"

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _PLANNER.match(p.name)))

    def save(self, state: dict[str, Any], *, keep_from: int | None = None) -> None:
        """Keep `state` (a `Planner.state_dict`, its ``step`` = the next step to plan); prune states
        older than the newest ``keep`` and, given, older than `keep_from` (the oldest step a
        constructor may still build: its state must survive however far planning ran ahead)."""
        step = int(state["step"])
        fp = state.get("fingerprint")
        with self._lock:
            if fp is not self._fingerprint and fp != self._fingerprint:
                write_atomic(self.directory / FINGERPRINT, {"fingerprint": fp})
            self._fingerprint = fp
        write_atomic(self.path(step), {**state, "fingerprint": FINGERPRINT})
        below = step - self.keep + 1 if keep_from is None else min(step - self.keep + 1, keep_from)
        with self._lock:  # pruned from what was written, not a listing of the directory per step
            if self._written is None:
                self._written = set(self.steps())
            self._written.add(step)
            for old in [s for s in self._written if s < below]:
                self.path(old).unlink(missing_ok=True)
                self._written.discard(old)

    def at(self, step: int) -> dict[str, Any] | None:
        """The state before `step`, or None when it was never written or was pruned."""
        return self._with_fingerprint(_read(self.path(step)))

    def latest(self) -> dict[str, Any] | None:
        steps = self.steps()
        return self._with_fingerprint(_read(self.path(steps[-1]))) if steps else None

    def _with_fingerprint(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        if state is not None and state.get("fingerprint") == FINGERPRINT:
            shared = _read(self.directory / FINGERPRINT)
            if shared is None:
                raise ResumeError(f"checkpoint directory {self.directory} has step states but no {FINGERPRINT}; "
                                  "delete the directory to start the service afresh")
            state["fingerprint"] = shared["fingerprint"]
        return state

    def save_reports(self, reports: dict[int, list]) -> None:
        """Keep the loss reports received (feedback mixing): a state file holds only those
        before its step, and a report is sent once."""
        write_atomic(self.directory / "reports.json", {"reports": [[k, v] for k, v in sorted(reports.items())]})

    def reports(self) -> dict[int, list]:
        got = _read(self.directory / "reports.json")
        return {} if got is None else {int(k): v for k, v in got["reports"]}

    def save_autoscaler(self, state: dict[str, Any]) -> None:
        """Keep the AutoScaler's state (policy, shard counts): a restarted Planner resumes the
        layout it had scaled to, not the offline partition."""
        write_atomic(self.directory / "autoscaler.json", state)

    def autoscaler(self) -> dict[str, Any] | None:
        return _read(self.directory / "autoscaler.json")

    def clear(self) -> None:
        """Remove every state (a fresh service must not restore another run's planner)."""
        for s in self.steps():
            self.path(s).unlink(missing_ok=True)
        (self.directory / "reports.json").unlink(missing_ok=True)
        (self.directory / "autoscaler.json").unlink(missing_ok=True)
        (self.directory / FINGERPRINT).unlink(missing_ok=True)
        with self._lock:
            self._fingerprint = None
            self._written = None
