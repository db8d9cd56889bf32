"""Fault injection: kill service actors on purpose, by schedule.

Schedules read ``"planner@every15"``, ``"loader:0-4@10"`` (loaders 0..4 at once at step 10),
``"constructor:1@every7"``, entries separated by commas, from `fault_tolerance.inject` or the
``MEGASCALE_FAULTS`` environment variable. A kill is a SIGKILL the actor sends itself (its
``crash`` method), so Ray sees exactly what it sees when a node's process dies. Plain Python: no
Ray or torch here.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megascale_data_ext.errors import ConfigError

__all__ = ["COMPONENTS", "ENV_VAR", "FaultEvent", "FaultInjector", "FaultSpec", "crash_self", "parse_faults"]

Component = Literal["loader", "planner", "constructor"]
COMPONENTS: tuple[str, ...] = ("loader", "planner", "constructor")
ENV_VAR = "MEGASCALE_FAULTS"


def crash_self() -> None:
    """SIGKILL this process: what an actor's ``crash`` does (Ray sees a dead node process)."""
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """Kill `component` (`indices` of it) at step `at`, or at every multiple of `every`."""

    component: Component
    indices: tuple[int, ...] = (0,)
    at: int | None = None
    every: int | None = None

    def fires(self, step: int) -> bool:
        if self.at is not None:
            return step == self.at
        return self.every is not None and step > 0 and step % self.every == 0


_ENTRY = re.compile(r"^(loader|planner|constructor)(?::(\d+)(?:-(\d+))?)?@(every)?(\d+)$")


def parse_faults(text: str) -> list[FaultSpec]:
    """Parse ``"planner@every15,loader:0-4@10,constructor:1@7"``; raises ConfigError naming bad entries."""
    out, bad = [], []
    for entry in (e.strip() for e in text.replace(";", ",").split(",")):
        if not entry:
            continue
        m = _ENTRY.match(entry)
        if m is None or (m.group(1) == "planner" and m.group(2)) or (m.group(4) and int(m.group(5)) < 1):
            bad.append(entry)
            continue
        comp, lo, hi, every, n = m.groups()
        first = int(lo or 0)
        indices = tuple(range(first, int(hi) + 1)) if hi else (first,)
        if not indices:
            bad.append(entry)
            continue
        out.append(FaultSpec(component=comp, indices=indices, at=None if every else int(n),
                             every=int(n) if every else None))
    if bad:
        raise ConfigError(f"bad fault schedule entries {bad} (in `fault_tolerance.inject` or ${ENV_VAR}); write "
                          "COMPONENT[:I[-J]]@STEP or COMPONENT[:I[-J]]@everyN, COMPONENT one of "
                          f"{list(COMPONENTS)}, e.g. 'planner@every15,loader:0-4@10'")
    return out


@dataclass(slots=True, kw_only=True)
class FaultEvent:
    """One kill: what, when (step and wall time)."""

    component: str
    index: int
    step: int
    time: float


@dataclass(slots=True)
class FaultInjector:
    """Fires a fault schedule: `on_step(step)` kills what is due, once per step.

    Args:
        specs: The schedule (`parse_faults`).
        crash: ``(component, index) -> None`` sends the actor its SIGKILL (``handle.crash.remote()``).
    """

    specs: Sequence[FaultSpec]
    crash: Callable[[str, int], Any]
    events: list[FaultEvent] = field(default_factory=list)
    _done: set[int] = field(default_factory=set)

    def on_step(self, step: int) -> list[FaultEvent]:
        if step in self._done:
            return []
        self._done.add(step)
        fired = []
        for spec in self.specs:
            if spec.fires(step):
                for i in spec.indices:
                    self.crash(spec.component, i)
                    fired.append(FaultEvent(component=spec.component, index=i, step=step, time=time.time()))
        self.events += fired
        return fired

    def kills(self, component: str) -> int:
        return sum(e.component == component for e in self.events)
