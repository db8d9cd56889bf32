"""Mixing schedules: which fraction of the data each source contributes at a training step.

Constant, curriculum phases (`PiecewiseSchedule`), a warm-up ramp, or loss feedback from the
trainer. Every schedule is rebuilt from its `to_config()` by `build.build_schedule`; its
checkpoint (`StateSchema` "mixing_schedule") is fingerprinted by that config, so a resume under
another schedule is refused, and holds the fields of the few schedules that learn (feedback).
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from megascale_data_ext.dataplane.mixing.checks import (
    check_weights,
    is_count,
    names_hint,
    names_tuple,
    raise_problems,
    weights_length,
)
from megascale_data_ext.errors import ConfigError, PlanError
from megascale_data_ext.state import Fingerprint, StateSchema

__all__ = [
    "ConstantSchedule",
    "FeedbackSchedule",
    "LinearRampSchedule",
    "MixingSchedule",
    "PiecewiseSchedule",
    "ScheduleType",
]

_HINT = "resume with the mixing schedule of the saved run (data.mixing)"


class ScheduleType(enum.StrEnum):
    """The schedule kinds ``build_schedule`` accepts as ``type``."""

    CONSTANT = "constant"
    PIECEWISE = "piecewise"
    RAMP = "ramp"
    FEEDBACK = "feedback"


@runtime_checkable
class MixingSchedule(Protocol):
    """Contract of every mixing schedule (held by the Planner actor, called once per step)."""

    @property
    def num_sources(self) -> int: ...

    def weights(self, step: int) -> np.ndarray:
        """Normalised float64 weights (sum 1, one per source) in effect at ``step``."""
        ...

    def to_config(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class _Schedule:
    """Shared plumbing: equality/repr from ``to_config`` and the stateless state protocol.

    Schedules are plain slotted classes rather than dataclasses because their constructor
    argument ``weights`` would collide with the ``weights(step)`` method.
    """

    __slots__ = ("_fingerprint", "source_names")
    STATE = StateSchema("mixing_schedule", 2, (), hint=_HINT)

    @abc.abstractmethod
    def to_config(self) -> dict[str, Any]:
        """The mapping `build_schedule` turns back into this schedule."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_config().items() if k != "type")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_config() == self.to_config()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def fingerprint(self) -> Fingerprint:
        """`to_config()` made JSON-normal once (a schedule's config does not change; its state is
        saved with every planned step, and at 1,000+ sources the config is thousands of weights)."""
        try:
            return self._fingerprint
        except AttributeError:
            self._fingerprint = Fingerprint.of(self.to_config())
            return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """Stateless schedules save only their config (the fingerprint), so a changed config is caught."""
        return self.STATE.stamp(self.fingerprint())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse (ResumeError) a state saved under another version or config."""
        self.STATE.check(state, self.to_config())


class ConstantSchedule(_Schedule):
    """The same mixture at every step (Megatron's ``--data-path w1 p1 w2 p2``). Stateless."""

    __slots__ = ("_raw", "_w")

    def __init__(self, weights: Sequence[float], *, source_names: Sequence[str] | None = None) -> None:
        self.source_names = names_tuple(source_names)
        problems: list[str] = []
        w = check_weights("weights", weights, self.source_names, problems)
        raise_problems(problems, "constant mixing schedule")
        self._raw, self._w = [float(x) for x in weights], w

    @property
    def num_sources(self) -> int:
        return int(self._w.size)

    def weights(self, step: int) -> np.ndarray:
        return self._w.copy()

    def to_config(self) -> dict[str, Any]:
        return {"type": ScheduleType.CONSTANT.value, "weights": list(self._raw)}


class PiecewiseSchedule(_Schedule):
    """A curriculum: ``weights[i]`` applies from ``boundaries[i]`` (in steps or epochs) on.

    ``boundaries[0]`` must be 0 so every step has a mixture. With ``unit="epoch"`` boundary
    ``b`` starts at step ``round(b * steps_per_epoch)`` (fractional epochs allowed). Stateless.
    """

    __slots__ = ("_boundaries", "_raw", "_starts", "_table", "steps_per_epoch", "unit")

    def __init__(
        self,
        boundaries: Sequence[float],
        weights: Sequence[Sequence[float]],
        *,
        unit: str = "step",
        steps_per_epoch: int | None = None,
        source_names: Sequence[str] | None = None,
    ) -> None:
        self.unit, self.steps_per_epoch, self.source_names = unit, steps_per_epoch, names_tuple(source_names)
        problems: list[str] = []
        if unit not in ("step", "epoch"):
            problems.append(f"`unit` must be one of ['step', 'epoch'], got {unit!r}")
        if unit == "epoch" and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                or steps_per_epoch <= 0):
            problems.append(f"`steps_per_epoch` must be a positive integer when unit='epoch', got {steps_per_epoch!r}")
        rows_in = [list(w) if isinstance(w, Sequence | np.ndarray) else w for w in weights]
        b = np.asarray(list(boundaries), dtype=np.float64)
        if b.ndim != 1 or b.size == 0 or b.size != len(rows_in):
            problems.append(f"`boundaries` and `weights` must be non-empty lists of the same length, got "
                            f"{len(b)} boundaries {list(boundaries)!r} and {len(rows_in)} weight lists")
        elif b[0] != 0 or not np.all(np.isfinite(b)) or np.any(np.diff(b) <= 0):
            problems.append(f"`boundaries` must start at 0 and strictly increase, got {list(boundaries)!r}")
        elif unit == "step" and np.any(b != np.round(b)):
            problems.append(f"`boundaries` must be whole steps when unit='step', got {list(boundaries)!r}")
        n = len(self.source_names) if self.source_names is not None else weights_length(rows_in[0] if rows_in else None)
        rows = [check_weights(f"weights[{i}]", w, self.source_names, problems, num_sources=n)
                for i, w in enumerate(rows_in)]
        raise_problems(problems, "piecewise mixing schedule")
        self._starts = np.round(b * (steps_per_epoch if unit == "epoch" else 1)).astype(np.int64)
        if np.any(np.diff(self._starts) <= 0):
            raise ConfigError(f"invalid piecewise mixing schedule: `boundaries` {list(boundaries)!r} (epochs) map to "
                              f"repeated steps {self._starts.tolist()}; space them at least one step apart")
        self._boundaries = [float(x) if unit == "epoch" else int(x) for x in b]
        self._raw = [[float(x) for x in r] for r in rows_in]  # type: ignore[union-attr]
        self._table = np.stack(rows)  # type: ignore[arg-type]

    @property
    def num_sources(self) -> int:
        return int(self._table.shape[1])

    @property
    def start_steps(self) -> np.ndarray:
        """First step of each phase (boundaries converted to steps)."""
        return self._starts.copy()

    def phase(self, step: int) -> int:
        """Index of the phase in effect at ``step`` (steps before 0 use phase 0)."""
        return max(int(np.searchsorted(self._starts, step, side="right")) - 1, 0)

    def weights(self, step: int) -> np.ndarray:
        return self._table[self.phase(step)].copy()

    def to_config(self) -> dict[str, Any]:
        return {"type": ScheduleType.PIECEWISE.value, "boundaries": list(self._boundaries),
                "weights": [list(r) for r in self._raw], "unit": self.unit, "steps_per_epoch": self.steps_per_epoch}


class LinearRampSchedule(_Schedule):
    """Linear warm-up from mixture ``start`` to mixture ``end`` over ``warmup_steps`` steps.

    ``start`` applies up to ``start_step``, ``end`` from ``start_step + warmup_steps`` on; the
    normalised mixtures are interpolated in between (so a source can fade in from 0). Stateless.
    """

    __slots__ = ("_a", "_b", "_raw", "start_step", "warmup_steps")

    def __init__(
        self,
        start: Sequence[float],
        end: Sequence[float],
        warmup_steps: int,
        start_step: int = 0,
        *,
        source_names: Sequence[str] | None = None,
    ) -> None:
        self.source_names = names_tuple(source_names)
        problems: list[str] = []
        n = len(self.source_names) if self.source_names is not None else weights_length(start)
        a = check_weights("start", start, self.source_names, problems, num_sources=n)
        b = check_weights("end", end, self.source_names, problems, num_sources=n)
        problems += [f"`{k}` must be a non-negative integer, got {v!r}"
                     for k, v in (("warmup_steps", warmup_steps), ("start_step", start_step)) if not is_count(v)]
        raise_problems(problems, "ramp mixing schedule")
        self._a, self._b = a, b
        self._raw = ([float(x) for x in start], [float(x) for x in end])
        self.warmup_steps, self.start_step = int(warmup_steps), int(start_step)

    @property
    def num_sources(self) -> int:
        return int(self._a.size)

    def weights(self, step: int) -> np.ndarray:
        if self.warmup_steps == 0:
            frac = 0.0 if step < self.start_step else 1.0
        else:
            frac = min(max((step - self.start_step) / self.warmup_steps, 0.0), 1.0)
        w = (1.0 - frac) * self._a + frac * self._b
        return w / w.sum()

    def to_config(self) -> dict[str, Any]:
        return {"type": ScheduleType.RAMP.value, "start": list(self._raw[0]), "end": list(self._raw[1]),
                "warmup_steps": self.warmup_steps, "start_step": self.start_step}


class FeedbackSchedule(_Schedule):
    """Weights steered by the per-source training loss the trainer reports (DoReMi-lite).

    After each report, ``w_s ∝ base_s · exp(lr · (ema_s − mean(ema)))``, where ``ema_s`` is an
    exponential moving average (``smoothing`` = weight of the past) of source ``s``'s loss; then
    the mixture is blended with uniform so every source with ``base_s > 0`` keeps at least
    ``min_weight`` (a floor stops a source from starving). Sources with ``base_s == 0`` stay 0;
    sources never reported count as average. Non-finite losses (a skipped Megatron step) are
    ignored and counted.

    ``weights(step)`` returns the mixture after the latest report: the single Planner actor
    sequences reports and plans, so the same reports in the same order give the same weights.
    ``delay`` is the d of "step k's report is applied exactly when planning step k + d": the
    Planner waits for that report, so a run (and a resume) is reproducible whatever the
    prefetch timing; pick d > the prefetch depth so planning never waits on the trainer.

    Checkpoint schema: ``{"version", "config", "ema": [float|None], "weights": [float],
    "last_step": int|None, "num_reports": int, "num_ignored": int}``.
    """

    __slots__ = ("_base", "_ema", "_raw", "_w", "delay", "last_step", "lr", "min_weight", "num_ignored",
                 "num_reports", "smoothing")
    STATE = StateSchema("mixing_schedule", 2, ("ema", "weights", "last_step", "num_reports", "num_ignored"),
                        hint=_HINT)

    def __init__(
        self,
        base_weights: Sequence[float],
        *,
        lr: float = 1.0,
        smoothing: float = 0.9,
        min_weight: float = 0.0,
        delay: int = 3,
        source_names: Sequence[str] | None = None,
    ) -> None:
        self.source_names = names_tuple(source_names)
        problems: list[str] = []
        base = check_weights("base_weights", base_weights, self.source_names, problems)
        if not is_count(delay) or delay < 1:
            problems.append(f"`delay` must be an integer >= 1 (step k's loss is applied at step k + delay), "
                            f"got {delay!r}")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            problems.append(f"`lr` must be a finite number >= 0, got {lr!r}")
        if not (isinstance(smoothing, (int, float)) and 0 <= smoothing < 1):
            problems.append(f"`smoothing` must be in [0, 1), got {smoothing!r}")
        if base is not None and isinstance(min_weight, (int, float)) and min_weight >= 0:
            k = int(np.count_nonzero(base))
            if min_weight * k >= 1:
                problems.append(f"`min_weight` * (sources with base weight > 0) must be < 1, got "
                                f"{min_weight!r} * {k} ({names_hint(self.source_names, base.size)})")
        else:
            problems.append(f"`min_weight` must be a number >= 0, got {min_weight!r}")
        raise_problems(problems, "feedback mixing schedule")
        self._raw, self._base = [float(x) for x in base_weights], base
        self.lr, self.smoothing, self.min_weight, self.delay = float(lr), float(smoothing), float(min_weight), delay
        self._ema = np.full(base.size, np.nan)
        self._w = self._floor(base.copy())
        self.last_step: int | None = None
        self.num_reports = self.num_ignored = 0

    @property
    def num_sources(self) -> int:
        return int(self._base.size)

    def weights(self, step: int) -> np.ndarray:
        return self._w.copy()

    @property
    def ema_losses(self) -> np.ndarray:
        """EMA of each source's reported loss (NaN where never reported)."""
        return self._ema.copy()

    def _floor(self, w: np.ndarray) -> np.ndarray:
        live = self._base > 0
        out = np.zeros_like(w)
        out[live] = self.min_weight + (1.0 - self.min_weight * live.sum()) * w[live] / w[live].sum()
        return out

    def _index(self, key: int | str) -> int:
        if isinstance(key, str) and self.source_names is not None and key in self.source_names:
            return self.source_names.index(key)
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool) and 0 <= key < self.num_sources:
            return int(key)
        raise PlanError(f"report_loss got unknown source {key!r}; use an index in [0, {self.num_sources}) "
                        f"or a name ({names_hint(self.source_names, self.num_sources)})")

    def report_loss(self, step: int, losses: Mapping[int | str, float]) -> None:
        """Fold the trainer's per-source losses for ``step`` into the mixture.

        Steps must be reported in increasing order, each once, so a replay after a restart
        cannot apply a report twice.
        """
        if self.last_step is not None and step <= self.last_step:
            raise PlanError(f"report_loss step {step} is not after the last reported step {self.last_step}; "
                            "report each step once, in increasing order")
        for key, loss in losses.items():
            i, value = self._index(key), float(loss)
            if not math.isfinite(value):
                self.num_ignored += 1
                continue
            prev = self._ema[i]
            self._ema[i] = value if np.isnan(prev) else self.smoothing * prev + (1.0 - self.smoothing) * value
        self.last_step, self.num_reports = int(step), self.num_reports + 1
        seen = ~np.isnan(self._ema)
        if seen.any():
            excess = np.where(seen, self._ema - self._ema[seen].mean(), 0.0)
            # Subtracting the max before exp keeps it finite for any lr * loss spread.
            logits = np.where(self._base > 0, self.lr * excess, -np.inf)
            w = self._base * np.exp(logits - logits.max())
            self._w = self._floor(w)

    def to_config(self) -> dict[str, Any]:
        return {"type": ScheduleType.FEEDBACK.value, "base_weights": list(self._raw), "lr": self.lr,
                "smoothing": self.smoothing, "min_weight": self.min_weight, "delay": self.delay}

    def state_dict(self) -> dict[str, Any]:
        return self.STATE.stamp(self.fingerprint(), ema=[None if np.isnan(x) else float(x) for x in self._ema],
                                weights=[float(x) for x in self._w], last_step=self.last_step,
                                num_reports=self.num_reports, num_ignored=self.num_ignored)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self.STATE.check(state, self.to_config())
        self._ema = np.array([np.nan if x is None else float(x) for x in state["ema"]], dtype=np.float64)
        self._w = np.asarray(state["weights"], dtype=np.float64).copy()
        self.last_step = None if state["last_step"] is None else int(state["last_step"])
        self.num_reports, self.num_ignored = int(state["num_reports"]), int(state["num_ignored"])
