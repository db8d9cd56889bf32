"""The cost model fitted online from the trainer's own step times, saved with the run.

`megascale-data profile --model` fits the calibrated cost (fixed per microbatch + linear +
quadratic in document lengths) once on the user's hardware; during training rank 0 keeps
refitting it from every step's measured time and the step's plan (which documents each DP
rank packed into which microbatch), so the balancer's notion of cost follows the real
machine. A synchronous step lasts as long as its slowest rank, so each step's time is
attributed to the rank the current fit predicts slowest (`OnlineCalibrator.
observe_synchronous_step`). At the end the fit and its predicted-vs-measured report are
written beside the run's checkpoints or logs as ``calibration.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.calibration import OnlineCalibrator, load_calibration

CALIBRATED_PREFIX = "calibrated:"


def plan_microbatches(plan: Any) -> list[list[list[int]]]:
    """Per DP bucket, per microbatch, the token lengths of the documents (spans) it packs."""
    return [[plan.tokens[(plan.bucket == b) & (plan.microbatch == j)].astype(int).tolist()
             for j in range(plan.num_microbatches)] for b in range(plan.num_buckets)]


class StepCalibration:
    """Rank 0's online fit: ``request(step)`` before a step, ``observe(step, seconds)`` after it,
    ``report()`` / ``save()`` at the end.

    Args:
        plan_of: ``step -> StepPlan`` (the Planner's plan of that step), or ``step -> () -> StepPlan``
            when fetching it takes a round trip: `request` starts it before the step runs, so the
            trainer never waits on it.
        strategy_args: The strategy's arguments; a ``model: calibrated:<path>`` fit is the prior.
        skip: First observed steps left out of the fit (start-up, first-call compilation).
    """

    def __init__(self, plan_of: Callable[[int], Any], strategy_args: Mapping[str, Any], *, skip: int = 1) -> None:
        model = str(strategy_args.get("model", ""))
        prior = load_calibration(model[len(CALIBRATED_PREFIX):]) if model.startswith(CALIBRATED_PREFIX) else None
        self.plan_of = plan_of
        self.online = OnlineCalibrator(prior=prior)
        self.skip = skip
        self.steps: list[tuple[list[list[list[int]]], float]] = []
        self._requested: dict[int, Any] = {}

    def request(self, step: int) -> None:
        """Start fetching `step`'s plan (overlaps the step itself)."""
        self._requested[step] = self.plan_of(step)

    def observe(self, step: int, seconds: float) -> None:
        plan = self._requested.pop(step) if step in self._requested else self.plan_of(step)
        ranks = plan_microbatches(plan() if callable(plan) else plan)
        self.steps.append((ranks, float(seconds)))
        if len(self.steps) > self.skip:
            self.online.observe_synchronous_step(ranks, float(seconds))

    def comparison(self) -> tuple[np.ndarray, np.ndarray]:
        """(predicted, measured) step seconds of the fitted steps: the slowest rank's prediction."""
        model = self.online.model()
        fitted = self.steps[self.skip:]
        predicted = np.asarray([float(np.max(model.predict(ranks))) for ranks, _ in fitted])
        return predicted, np.asarray([s for _, s in fitted])

    def report(self) -> str:
        """One line: the fitted coefficients and predicted vs measured step time."""
        if self.online.steps == 0:
            return f"[calibration] no step fitted yet ({len(self.steps)} observed, first {self.skip} skipped)"
        model = self.online.model()
        predicted, measured = self.comparison()
        err = np.abs(predicted - measured) / measured
        few = len(measured) < 3 or np.std(predicted) == 0  # the three terms need varied steps to separate
        r = "n/a (< 3 varied steps)" if few else f"{float(np.corrcoef(predicted, measured)[0, 1]):.3f}"
        return (f"[calibration] fixed {model.fixed * 1e3:.2f} ms/microbatch, {model.per_document * 1e3:.3f} ms/document, "
                f"linear {model.linear * 1e6:.3f} us/token, "
                f"quadratic {model.quadratic * 1e9:.4f} ns/token^2 from {self.online.steps} steps | step predicted "
                f"{predicted.mean():.3f} s vs measured {measured.mean():.3f} s "
                f"(mean abs error {100 * err.mean():.1f}%, Pearson r {r})")

    def save(self, directory: str | Path) -> Path:
        """Write ``calibration.json`` (the fit, reusable as ``model: calibrated:<path>``) and the
        online state and per-step predicted/measured times beside it."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = self.online.model().save(out / "calibration.json")
        predicted, measured = self.comparison() if self.online.steps else (np.zeros(0), np.zeros(0))
        (out / "calibration_online.json").write_text(json.dumps(
            {"state": self.online.state_dict(), "predicted_s": predicted.tolist(), "measured_s": measured.tolist()}))
        return path
