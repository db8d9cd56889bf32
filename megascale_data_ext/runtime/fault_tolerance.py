"""How the service survives killed actors: the `fault_tolerance` settings (paper Sec. 6).

The Planner checkpoints its state after every planned step and is restarted by Ray; loaders
re-read from the plans after a restart and have optional warm shadows; Data Constructors are
restarted and rebuild in-flight steps from the plans; clients wait out a recovery within bounded
retries and then raise `ServiceUnavailableError`. Plain Python: no Ray or torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.fault_injection import ENV_VAR, FaultSpec, parse_faults

__all__ = ["FaultToleranceConfig"]


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
        client_prefetch: Steps a client keeps requested ahead (rides out a recovery; paper: 4); under
            feedback mixing at most ``delay - 1`` (`within_report_delay`).
        max_lead_steps: Most steps a Data Constructor builds ahead of its slowest consumer; a
            consumer further ahead waits (backpressure bounds memory; nothing is dropped).
            None = what the prefetch settings need: ``prefetch + client_prefetch + 1``.
        rpc_timeout_s: One wait on a loader or constructor call before it counts as failed.
        recovery_timeout_s: Longest a client or constructor waits for a killed actor to come back.
        retries: Most re-resolutions of a dead actor per request before `ServiceUnavailableError`.
        hedge_s: A loader call unanswered this long is also sent to the shadow (first answer wins).
        suspect_s: After a loader failure, how long its shadow serves before the primary is tried again.
        report_timeout_s: Longest a plan waits for a loss report its feedback mixing needs. Nothing is
            asked for before its reports can exist, so this bounds only a report never sent, which
            is then a `ReportTimeoutError` naming its step (or the client's, at its own deadline).
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
    report_timeout_s: float = 600.0
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
                     for k in ("rpc_timeout_s", "recovery_timeout_s", "hedge_s", "suspect_s", "report_timeout_s")
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

    def within_report_delay(self, delay: int | None) -> FaultToleranceConfig:
        """These settings with no client asking for a step before it can be planned.

        Under feedback mixing of delay d, step s waits for the trainer's loss report of step s - d, so
        a rank on step p can have steps up to p + d - 1 planned. A request further ahead only parks a
        call in the Planner until the trainer reports; enough of them take every Planner thread, and
        a step the trainer needs next then queues behind calls that wait for that very trainer (a
        constructor Ray restarted asks for it last). So clients ask at most d - 1 steps ahead (and the
        default `max_lead` follows); constructors prefetch no further either (`DataConstructor.plannable`).
        No data comes later for it: a step further ahead could not have been planned sooner.
        """
        if delay is None or self.client_prefetch <= delay - 1:
            return self
        return replace(self, client_prefetch=delay - 1)

    def actor_options(self, *, retry_tasks: bool) -> dict[str, int]:
        """Ray restart options; `retry_tasks` re-runs calls in flight on the restarted actor
        (only for idempotent actors: the Planner)."""
        if not self.restart:
            return {}
        return {"max_restarts": -1, "max_task_retries": -1 if retry_tasks else 0}

    def schedule(self) -> list[FaultSpec]:
        """The configured fault schedule plus ``MEGASCALE_FAULTS``."""
        return parse_faults(self.inject) + parse_faults(os.environ.get(ENV_VAR, ""))
