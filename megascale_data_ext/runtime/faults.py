"""Fault tolerance settings, the error a client raises when recovery fails, and fault injection.

`FaultToleranceConfig` decides how the service survives a killed actor (paper Sec. 6): the
Planner checkpoints its state after every planned step and is restarted by Ray; Source
Loaders re-read from the plans after a restart and have optional warm shadows;
Data Constructors are restarted and rebuild in-flight steps from the plans; clients wait
out a recovery within bounded retries and then raise `ServiceUnavailableError`.

Fault injection kills actors on purpose, by schedule: ``"planner@every15"``,
``"loader:0-4@10"`` (loaders 0..4 at once at step 10), ``"constructor:1@every7"``, entries
separated by commas, from `FaultToleranceConfig.inject` or the ``MEGASCALE_FAULTS``
environment variable. A kill is a SIGKILL the actor sends itself (its ``crash`` method), so
Ray sees exactly what it sees when a node's process dies. Plain Python: no Ray or torch here.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megascale_data_ext.errors import ConfigError, MegascaleDataError

__all__ = ["COMPONENTS", "ENV_VAR", "FaultEvent", "FaultInjector", "FaultSpec", "FaultToleranceConfig",
           "ServiceUnavailableError", "crash_self", "parse_faults"]

Component = Literal["loader", "planner", "constructor"]
COMPONENTS: tuple[str, ...] = ("loader", "planner", "constructor")
ENV_VAR = "MEGASCALE_FAULTS"


def crash_self() -> None:
    """SIGKILL this process: what an actor's ``crash`` does (Ray sees a dead node process)."""
    os.kill(os.getpid(), signal.SIGKILL)



class ServiceUnavailableError(MegascaleDataError):
    """A service actor did not come back within the retry budget; names it and what to do."""


@dataclass(slots=True, kw_only=True)
class FaultToleranceConfig:
    """How the service recovers from killed actors (proposed as ``ServiceConfig.fault_tolerance``).

    Attributes:
        restart: Let Ray restart killed actors (``max_restarts=-1``); off, a kill ends the run.
        checkpoint_dir: Where the Planner writes its state after every planned step; None = a
            fresh temporary directory per service (a multi-node cluster needs a shared path).
        checkpoint_keep: Planner states kept on disk (the oldest step a restarted Planner can re-plan).
        shadow_loaders: Start a warm shadow beside every loader actor that serves while it is down
            (`runtime.shadows`).
        client_prefetch: Steps a client keeps requested ahead (rides out a recovery; paper: 4).
        max_lead_steps: Most steps a Data Constructor builds ahead of its slowest consumer; a
            consumer further ahead waits (backpressure bounds memory; nothing is dropped).
            None = what the prefetch settings need: ``prefetch + client_prefetch + 1``.
        rpc_timeout_s: One wait on a loader or constructor call before it counts as failed.
        recovery_timeout_s: Longest a client or constructor waits for a killed actor to come back.
        retries: Most re-resolutions of a dead actor per request before `ServiceUnavailableError`.
        hedge_s: A loader call unanswered this long is also sent to the shadow (first answer wins).
        suspect_s: After a loader failure, how long its shadow serves before the primary is tried again.
        inject: Fault schedule (see module docstring); ``MEGASCALE_FAULTS`` adds to it.
    """

    restart: bool = True
    checkpoint_dir: str | None = None
    checkpoint_keep: int = 32
    shadow_loaders: bool = False
    client_prefetch: int = 4
    max_lead_steps: int | None = None
    rpc_timeout_s: float = 30.0
    recovery_timeout_s: float = 120.0
    retries: int = 8
    hedge_s: float = 1.0
    suspect_s: float = 5.0
    inject: str = ""

    def __post_init__(self) -> None:
        problems = self.field_problems({f: getattr(self, f) for f in self.__dataclass_fields__})
        if problems:
            raise ConfigError("invalid fault_tolerance config:\n  - " +
                              "\n  - ".join(f"`fault_tolerance.{k}`: {m}" for k, m in problems))

    @classmethod
    def field_problems(cls, values: dict[str, Any]) -> list[tuple[str, str]]:
        """What is wrong with these field values, as ``(field, message)`` (the config names them)."""
        get = values.get
        problems = [(k, f"must be an integer >= 1, got {get(k)!r}")
                    for k in ("checkpoint_keep", "retries")
                    if k in values and (not isinstance(get(k), int) or get(k) < 1)]
        if "client_prefetch" in values and (not isinstance(get("client_prefetch"), int) or get("client_prefetch") < 0):
            problems.append(("client_prefetch", f"must be an integer >= 0, got {get('client_prefetch')!r}"))
        lead = get("max_lead_steps")
        if lead is not None and (not isinstance(lead, int) or isinstance(lead, bool) or lead < 1):
            problems.append(("max_lead_steps", f"must be an integer >= 1 or null (= prefetch + client_prefetch + 1), "
                                               f"got {lead!r}"))
        problems += [(k, f"must be > 0 seconds, got {get(k)!r}")
                     for k in ("rpc_timeout_s", "recovery_timeout_s", "hedge_s", "suspect_s")
                     if k in values and not get(k) > 0]
        if values.get("inject"):
            try:
                parse_faults(values["inject"])  # a bad schedule fails at configuration time
            except ConfigError as e:
                problems.append(("inject", str(e)))
        return problems

    def max_lead(self, prefetch: int) -> int:
        """Steps a constructor with `prefetch` builds ahead of its slowest consumer (`max_lead_steps`)."""
        return self.max_lead_steps if self.max_lead_steps is not None else prefetch + self.client_prefetch + 1

    def actor_options(self, *, retry_tasks: bool) -> dict[str, int]:
        """Ray restart options; `retry_tasks` re-runs calls in flight on the restarted actor
        (only for idempotent actors: the Planner)."""
        if not self.restart:
            return {}
        return {"max_restarts": -1, "max_task_retries": -1 if retry_tasks else 0}

    def schedule(self) -> list[FaultSpec]:
        """The configured fault schedule plus ``MEGASCALE_FAULTS``."""
        return parse_faults(self.inject) + parse_faults(os.environ.get(ENV_VAR, ""))


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
