"""Mixture-driven scaling policy (MegaScale-Data Sec. 5.2) as a pure state machine.

The Planner sees every step's mixture, so it can scale a source's loaders before the demand
arrives. Each interval the policy takes the sampling weights the plans realised, keeps their
moving average over `window` intervals, and compares it with thresholds: a source whose
average needs more shards than it has (``ceil(avg / capacity)``, capacity = the weight one
shard keeps up with) for `patience` consecutive intervals is scaled up; one whose average
stays below ``(1 - hysteresis)`` of the capacity of fewer shards is scaled down (idle
loaders reclaimed). Hysteresis and patience keep a noisy mixture from thrashing actors.

Decisions are values; `runtime.autoscaler` turns them into actors and a live reshard.

Checkpoint (`StateSchema` "scaling_policy", version 2): fingerprint = the config and the
number of sources; fields ``interval``, ``weights`` (the last `window` intervals' weights as
given, oldest first: the autoscaler's are sample counts, integers, which JSON writes ~10x faster
than the normalised floats version 1 kept; the history is normalised again on load, to the same
floats), ``shards`` and ``streaks`` (signed consecutive-interval counters).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError, ResumeError
from megascale_data_ext.state import Fingerprint, StateSchema

__all__ = ["ScalingConfig", "ScalingDecision", "ScalingPolicy", "shard_capacity"]


@dataclass(slots=True, kw_only=True, frozen=True)
class ScalingConfig:
    """Thresholds of the policy.

    Attributes:
        capacity: Per source, the mixture weight one shard (one loader actor) keeps up with.
        window: Intervals in the moving average.
        patience: Consecutive intervals a crossing must hold before acting.
        hysteresis: Scale down only below ``(1 - hysteresis)`` of the smaller shard count's capacity.
        min_shards: Fewest shards of a source.
        max_shards: Most shards of a source (data parallel degree bound, w_src / w_actor).
    """

    capacity: tuple[float, ...]
    window: int = 4
    patience: int = 2
    hysteresis: float = 0.25
    min_shards: int = 1
    max_shards: int = 8

    def __post_init__(self) -> None:
        problems = [f"`capacity` of source {i} must be > 0, got {c!r}" for i, c in enumerate(self.capacity)
                    if not c > 0]
        problems += [f"`{k}` must be >= 1, got {getattr(self, k)!r}" for k in ("window", "patience", "min_shards")
                     if getattr(self, k) < 1]
        if self.max_shards < self.min_shards:
            problems.append(f"`max_shards` ({self.max_shards}) must be >= `min_shards` ({self.min_shards})")
        if not 0 <= self.hysteresis < 1:
            problems.append(f"`hysteresis` must be in [0, 1), got {self.hysteresis!r}")
        if problems:
            raise ConfigError("invalid scaling config:\n  - " + "\n  - ".join(problems))


@dataclass(slots=True, kw_only=True, frozen=True)
class ScalingDecision:
    """Source `source` goes from `old` to `new` shards, decided at `interval`."""

    source: int
    old: int
    new: int
    interval: int


def shard_capacity(cost_s: float, samples_per_step: int, step_seconds: float, workers_per_actor: int) -> float:
    """The mixture weight one actor of `workers_per_actor` workers keeps up with at `cost_s` per sample."""
    if cost_s <= 0:
        return 1.0
    return min(1.0, workers_per_actor * step_seconds / (samples_per_step * cost_s))


class ScalingPolicy:
    """Per-source shard counts driven by the moving-average mixture; not thread-safe (the Planner's lock)."""

    STATE = StateSchema("scaling_policy", 2, ("interval", "weights", "shards", "streaks"),
                        hint="resume with the same scaling config and sources")

    def __init__(self, config: ScalingConfig, initial_shards: Sequence[int] | None = None) -> None:
        self.config = config
        n = len(config.capacity)
        self.shards = [self._clamp(s) for s in (initial_shards or [config.min_shards] * n)]
        if len(self.shards) != n:
            raise ConfigError(f"{len(self.shards)} initial shard counts for {n} sources")
        # per source, the last `window` intervals' weights, oldest first (every interval feeds every
        # source, so all have the same length): one array, so an interval at 1,000+ sources is a few
        # vector operations, not a loop over the sources
        self._history = np.zeros((n, 0), dtype=np.float64)
        self._weights: list[list[float]] = []  # the intervals of `_history` as given (what a state saves)
        self.streaks = [0] * n  # > 0: intervals wanting more shards in a row; < 0: fewer
        self.interval = 0
        self._capacity = np.asarray(config.capacity, dtype=np.float64)
        self._fingerprint = Fingerprint.of({"config": asdict(config), "sources": n})

    @property
    def history(self) -> list[list[float]]:
        """Per source, the weights of the last `window` intervals, oldest first."""
        return self._history.tolist()

    def _clamp(self, shards: int) -> int:
        return max(self.config.min_shards, min(self.config.max_shards, int(shards)))

    def moving_average(self, source: int) -> float:
        h = self._history[source].tolist()
        return sum(h) / len(h) if h else 0.0

    def _moving_averages(self) -> np.ndarray:
        """`moving_average` of every source, summed in the same order (the same floats)."""
        h = self._history
        if not h.shape[1]:
            return np.zeros(h.shape[0])
        acc = h[:, 0].copy()
        for j in range(1, h.shape[1]):
            acc += h[:, j]
        return acc / h.shape[1]

    def wanted(self, source: int) -> int:
        """The shard count the current moving average asks for, hysteresis applied when shrinking."""
        avg, cap, cur = self.moving_average(source), self.config.capacity[source], self.shards[source]
        up = self._clamp(math.ceil(avg / cap - 1e-12))
        if up > cur:
            return up
        down = self._clamp(math.ceil(avg / (cap * (1 - self.config.hysteresis)) - 1e-12))
        return down if down < cur else cur

    def observe(self, weights: Sequence[float]) -> list[ScalingDecision]:
        """Feed one interval's realised sampling weights (any scale; normalised here)."""
        n = len(self.shards)
        if len(weights) != n:
            raise ConfigError(f"scaling policy: {len(weights)} weights for {n} sources")
        self._push(list(weights))
        cfg, cur = self.config, np.asarray(self.shards, dtype=np.int64)
        avg = self._moving_averages()
        up = np.clip(np.ceil(avg / self._capacity - 1e-12), cfg.min_shards, cfg.max_shards).astype(np.int64)
        down = np.clip(np.ceil(avg / (self._capacity * (1 - cfg.hysteresis)) - 1e-12),
                       cfg.min_shards, cfg.max_shards).astype(np.int64)
        want = np.where(up > cur, up, np.where(down < cur, down, cur))  # `wanted`, every source at once
        sign = np.sign(want - cur)
        streaks = np.asarray(self.streaks, dtype=np.int64)
        streaks = np.where((sign != 0) & (streaks * sign > 0), streaks + sign, sign)
        out = []
        for s in np.flatnonzero((sign != 0) & (np.abs(streaks) >= cfg.patience)).tolist():
            out.append(ScalingDecision(source=s, old=self.shards[s], new=int(want[s]), interval=self.interval))
            self.shards[s] = int(want[s])
            streaks[s] = 0
        self.streaks = streaks.tolist()
        self.interval += 1
        return out

    def _push(self, weights: list[float]) -> None:
        """Append one interval's weights to the window (normalised into `_history`)."""
        total = float(sum(weights))
        norm = np.asarray(weights, dtype=np.float64) / total if total > 0 else np.zeros(len(weights))
        self._history = np.concatenate([self._history, norm[:, None]], axis=1)[:, -self.config.window:]
        self._weights = (self._weights + [weights])[-self.config.window:]

    # -- state ---------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return self.STATE.stamp(self.fingerprint(), interval=self.interval, weights=self._weights,
                                shards=self.shards, streaks=self.streaks)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fields = self.STATE.check(state, self.fingerprint())
        n = len(self.shards)
        if any(len(w) != n for w in fields["weights"]) or len(fields["weights"]) > self.config.window:
            raise ResumeError(f"scaling policy state: its weights are not at most {self.config.window} intervals of "
                              f"{n} sources; the state is damaged: resume from another one")
        self.interval = int(fields["interval"])
        self._history, self._weights = np.zeros((n, 0), dtype=np.float64), []
        for w in fields["weights"]:
            self._push(list(w))
        self.shards = [int(x) for x in fields["shards"]]
        self.streaks = [int(x) for x in fields["streaks"]]
