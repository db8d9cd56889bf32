"""Error hierarchy shared by every part of the service.

User-facing problems raise one of these (never ``assert``): the message names the file,
source, row or config field and says what to do about it.
"""

from __future__ import annotations

import sys


class MegascaleDataError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(MegascaleDataError, ValueError):
    """A configuration value is invalid; the message lists every problem found."""


class ParallelLayoutError(ConfigError):
    """Parallel sizes that cannot describe the world (e.g. world % (tp*cp*pp) != 0)."""


class PlanError(MegascaleDataError):
    """The planner cannot build a plan for a step (e.g. a sample that fits no microbatch)."""


class ReportTimeoutError(PlanError):
    """A step's plan waited `report_timeout_s` for a loss report its feedback mixing needs.

    Planning waits for the reports of steps up to ``step - delay``; a request sent ahead of the
    trainer (client prefetch) waits through the trainer's own pauses (evaluation, a checkpoint
    save) and may time out with nothing wrong. A client re-sends such a request once when it takes
    the step (`RemoteConstructors`): by then the report is there, or it is really missing.
    """


class ShortBufferError(PlanError):
    """The metadata the Planner holds of some sources is shorter than a step's draws from them.

    Attributes:
        needs: Per short source, how many samples the step needs of it; the Planner fetches that
            much and plans the step again, unless it exceeds ``buffer_size`` (then this is the error).
    """

    def __init__(self, message: str, needs: dict[int, int]) -> None:
        super().__init__(message)
        self.needs = needs


class CapacityError(PlanError):
    """A step's samples do not fit its microbatch bins (too many tokens for DP x m x cap).

    The Planner defers the samples that do not fit to the next step (`overflow="defer"`)
    or raises this (`overflow="error"`).
    """


class SourceError(MegascaleDataError):
    """A source cannot be opened or read: missing/corrupt file, wrong columns, empty source."""


class SampleError(MegascaleDataError):
    """One sample is bad (undecodable image, too long with truncation off).

    Source Loaders skip and count these under a tolerance policy; the error carries where
    the sample came from so the count report can name it.
    """

    def __init__(self, message: str, *, source: str | None = None, path: str | None = None, row: int | None = None):
        where = ", ".join(f"{k}={v}" for k, v in (("source", source), ("file", path), ("row", row)) if v is not None)
        super().__init__(f"{message} ({where})" if where else message)
        self.source, self.path, self.row = source, path, row


class JobMismatchError(ConfigError):
    """A client of one data service (job) asked another's actors; names both jobs."""


class ResumeError(MegascaleDataError, ValueError):
    """A saved data state does not match the current configuration; names the changed field."""


def root_cause(exc: BaseException) -> BaseException:
    """The error a service actor raised, unwrapped from Ray's ``RayTaskError`` layers.

    An error inside a Source Loader reaches the trainer wrapped once per actor hop (loader ->
    constructor -> client), each layer's message carrying the whole remote traceback. This
    returns the innermost cause (e.g. the loader's `SourceError`), or `exc` itself when it is no
    Ray wrapper. Ray is not imported: a process that never loaded it holds no Ray error.
    """
    wrapper = getattr(sys.modules.get("ray.exceptions"), "RayTaskError", None)
    for _ in range(16):  # one layer per actor hop; bounded against a self-referencing cause
        cause = getattr(exc, "cause", None) if wrapper is not None and isinstance(exc, wrapper) else None
        if not isinstance(cause, BaseException) or cause is exc:
            return exc
        exc = cause
    return exc


class ServiceUnavailableError(MegascaleDataError):
    """A service actor did not come back within the retry budget; names it and what to do."""
