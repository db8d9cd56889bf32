"""A cost model calibrated from measured step times: fixed per-microbatch + FLOPs-shaped terms.

FLOPs alone mispredict small and medium microbatches: on a GPU every microbatch also pays a
fixed time (kernel launches, Python and framework work per forward + backward; ≈ 19 ms on an H100 at hidden 2048,
issue 8) that the FLOPs model lacks, so predicted speedups of balancing come out too high. The calibrated model
keeps the FLOPs model's shape (linear in tokens, quadratic per document for per-document
attention), adds what each document costs by itself (its own attention call, boundaries,
per-document kernels: packs of many short documents run slower than their tokens say), and fits
four non-negative coefficients in seconds:

    t(microbatch) = fixed + per_document · n + linear · Σ s_d + quadratic · Σ s_d²   (d = its n documents)

An observation is a list of microbatches (each a list of document lengths) and the seconds
they took together (one microbatch, or one rank's whole step: the terms just add up). The fit
is non-negative least squares on relative residuals (timing noise is multiplicative), solved
exactly by trying every active set of the coefficients — numpy only, no scipy. Version 1 files and
states (three terms, no per-document one) still load, with a per-document cost of 0.

A microbatch also takes at least the host's time to launch its forward + backward (Python,
framework and kernel launches), however little the device has to do: below that `floor` the
step is launch-bound and its time no longer follows tokens (measured on an H100 at hidden 2048,
8 layers: every pack up to ~4,000 tokens took 38–52 ms, issue 18). So

    t(microbatch) = max(floor, fixed + per_document · n + linear · Σ s_d + quadratic · Σ s_d²)

and the fit searches the floor: for each candidate it fits the device terms to the microbatches
above it (alternating which ones sit on the floor) and keeps the floor only where it explains
the times clearly better than none (floor 0 = the additive model above).

As a per-sample `CostModel` (what the balancers call) a `CalibratedCost` returns
``per_document + linear·s + quadratic·s²`` seconds; the fixed term is the same for every microbatch, so it
does not move a balancer's choice, but `microbatch_seconds` / `predict` include it and so do
the predicted speedups. Saved as JSON with the hardware and model shape it was fitted for
(`floor_s` is optional in a version 2 file: older files load with no floor).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError

__all__ = [
    "CalibratedCost",
    "CalibrationReport",
    "OnlineCalibrator",
    "features",
    "fit_calibration",
    "load_calibration",
]

FORMAT = "megascale-data calibration"
VERSION = 2
TERMS = ("fixed", "per_document", "linear", "quadratic")
#: Fewest observations a fit takes (the per-document term is 0 where they cannot tell it apart).
MIN_OBSERVATIONS = 3

Microbatches = Sequence[Sequence[int] | np.ndarray]


def features(microbatches: Microbatches, *, where: str = "observation") -> np.ndarray:
    """The regressors of some microbatches: [count, documents, Σ tokens, Σ doc_len²] (float64[4]).

    Raises:
        ConfigError: a negative or non-finite document length, or no microbatch at all.
    """
    if len(microbatches) == 0:
        raise ConfigError(f"{where}: needs at least one microbatch (a list of document lengths)")
    tokens = quad = 0.0
    documents = 0
    for j, docs in enumerate(microbatches):
        s = np.asarray(docs, dtype=np.float64).reshape(-1)
        if s.size and (not np.all(np.isfinite(s)) or s.min() < 0):
            raise ConfigError(f"{where}, microbatch {j}: document lengths must be finite and >= 0, got {s.tolist()}")
        documents += s.size
        tokens += float(s.sum())
        quad += float(np.dot(s, s))
    return np.array([float(len(microbatches)), float(documents), tokens, quad])


def _microbatch_rows(microbatches: Microbatches, *, where: str = "observation") -> np.ndarray:
    """`features` of each microbatch alone: [m, 4]."""
    if len(microbatches) == 0:
        raise ConfigError(f"{where}: needs at least one microbatch (a list of document lengths)")
    return np.stack([features([mb], where=f"{where}, microbatch {j}") for j, mb in enumerate(microbatches)])


def _on_floor(device_seconds: np.ndarray, floor: float) -> np.ndarray:
    return np.maximum(device_seconds, floor) if floor > 0 else device_seconds


def _upgrade_normal(gram: np.ndarray, rhs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Version 1's 3-term normal equations as 4-term ones (no per-document information: zeros)."""
    if gram.shape == (4, 4):
        return gram, rhs
    keep = [0, 2, 3]
    g, r = np.zeros((4, 4)), np.zeros(4)
    g[np.ix_(keep, keep)], r[keep] = gram, rhs
    return g, r


def _nnls_normal(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """argmin_{x >= 0} xᵀGx − 2bᵀx by trying every active set (exact; 15 sets for 4 unknowns)."""
    n = gram.shape[0]
    best, best_obj = np.zeros(n), 0.0
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            idx = list(subset)
            sol = np.linalg.lstsq(gram[np.ix_(idx, idx)], rhs[idx], rcond=None)[0]
            if np.any(sol < 0):
                continue
            x = np.zeros(n)
            x[idx] = sol
            obj = float(x @ gram @ x - 2 * rhs @ x)
            if obj < best_obj - 1e-15 * max(1.0, abs(best_obj)):
                best, best_obj = x, obj
    return best


def _solve(gram: np.ndarray, rhs: np.ndarray, weight: float) -> np.ndarray:
    """NNLS on weighted normal equations, with columns scaled to unit size first (the regressors
    differ by ~10⁸ in magnitude)."""
    diag = np.diag(gram)
    scale = np.sqrt(np.where(diag > 0, diag / max(weight, 1e-300), 1.0))
    return _nnls_normal(gram / np.outer(scale, scale), rhs / scale) / scale


@dataclass(slots=True, kw_only=True)
class CalibrationReport:
    """Predicted vs measured seconds of the observations a model was fitted on (or checked on)."""

    measured: np.ndarray
    predicted: np.ndarray

    @property
    def pearson_r(self) -> float | None:
        if self.measured.size < 2 or np.ptp(self.measured) == 0 or np.ptp(self.predicted) == 0:
            return None
        return float(np.corrcoef(self.measured, self.predicted)[0, 1])

    @property
    def mean_abs_pct_error(self) -> float:
        return float(np.mean(np.abs(self.predicted - self.measured) / self.measured) * 100.0)

    @property
    def max_abs_pct_error(self) -> float:
        return float(np.max(np.abs(self.predicted - self.measured) / self.measured) * 100.0)

    def to_dict(self) -> dict[str, Any]:
        return {"observations": int(self.measured.size), "pearson_r": self.pearson_r,
                "mean_abs_pct_error": self.mean_abs_pct_error, "max_abs_pct_error": self.max_abs_pct_error}

    def format(self, labels: Sequence[str] | None = None, limit: int = 12) -> str:
        """A predicted-vs-measured table (first `limit` rows) and the summary line."""
        lines = ["| observation | measured ms | predicted ms | error % |", "|---|---|---|---|"]
        for i in range(min(limit, self.measured.size)):
            label = labels[i] if labels is not None else str(i)
            err = (self.predicted[i] - self.measured[i]) / self.measured[i] * 100
            lines.append(f"| {label} | {self.measured[i] * 1e3:.2f} | {self.predicted[i] * 1e3:.2f} | {err:+.1f} |")
        if self.measured.size > limit:
            lines.append(f"| … {self.measured.size - limit} more | | | |")
        r = self.pearson_r
        lines.append(f"\nPearson r {'n/a' if r is None else f'{r:.4f}'}, mean |error| "
                     f"{self.mean_abs_pct_error:.1f}%, max |error| {self.max_abs_pct_error:.1f}% "
                     f"over {self.measured.size} observations")
        return "\n".join(lines)


@dataclass(slots=True, kw_only=True)
class CalibratedCost:
    """Seconds of a microbatch = max(floor, fixed + per_document·documents + linear·tokens +
    quadratic·Σ doc_len²) (all >= 0; `per_document` and `floor` default to 0, older fits).

    `fitted_for` records what the fit holds for (device, dtype, model shape, attention kind);
    `fit` the fit's summary (`CalibrationReport.to_dict`). Immutable in use; thread-safe.
    """

    fixed: float
    linear: float
    quadratic: float
    per_document: float = 0.0
    floor: float = 0.0
    fitted_for: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [f"`{k}`={float(v)!r}" for k, v in zip((*TERMS, "floor"), (*self.coefficients(), self.floor),
                                                     strict=True) if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ConfigError(f"calibrated cost coefficients must be finite and >= 0, got {', '.join(bad)}")

    @property
    def __name__(self) -> str:  # strategies and logs name cost models by __name__
        return f"CalibratedCost({self.fitted_for.get('name', 'custom')})"

    def coefficients(self) -> np.ndarray:
        return np.array([self.fixed, self.per_document, self.linear, self.quadratic], dtype=np.float64)

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        """Per-sample seconds without the fixed term (what balancing a step can move)."""
        s = np.asarray(lengths, dtype=np.float64)
        return self.per_document + s * (self.linear + self.quadratic * s)

    flops = __call__  # the name other cost models use for their per-sample cost

    def microbatch_seconds(self, doc_lens: Sequence[int] | np.ndarray) -> float:
        """Predicted seconds of one microbatch holding documents of these lengths."""
        return float(max(self.floor, features([doc_lens]) @ self.coefficients()))

    def predict(self, observations: Iterable[Microbatches]) -> np.ndarray:
        """Predicted seconds of each observation (a list of microbatches of document lengths)."""
        x = self.coefficients()
        return np.array([_on_floor(_microbatch_rows(obs) @ x, self.floor).sum() for obs in observations],
                        dtype=np.float64)

    def rank_seconds(self, bin_tokens: np.ndarray, bin_quadratic: np.ndarray, *, nonempty: np.ndarray | None = None,
                     bin_documents: np.ndarray | None = None) -> np.ndarray:
        """Seconds per rank from per-(rank, microbatch) token, Σ s² and document sums ([k, m] arrays;
        without `bin_documents` the per-document term is left out).

        Empty microbatches (nonempty False, default: zero tokens) pay no fixed term.
        """
        bins = np.asarray(bin_tokens, dtype=np.float64)
        used = bins > 0 if nonempty is None else np.asarray(nonempty, dtype=bool)
        per_bin = self.fixed * used + self.linear * bins + self.quadratic * np.asarray(bin_quadratic, np.float64)
        if bin_documents is not None:
            per_bin = per_bin + self.per_document * np.asarray(bin_documents, np.float64)
        if self.floor > 0:
            per_bin = np.where(used, np.maximum(per_bin, self.floor), per_bin)
        return per_bin.sum(axis=-1)

    @property
    def quadratic_over_linear(self) -> float | None:
        return self.quadratic / self.linear if self.linear > 0 else None

    def report(self, observations: Sequence[Microbatches], seconds: Sequence[float]) -> CalibrationReport:
        return CalibrationReport(measured=_seconds(seconds, len(observations)), predicted=self.predict(observations))

    # -- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION,
                "coefficients": {"fixed_s": self.fixed, "per_document_s": self.per_document,
                                 "linear_s_per_token": self.linear, "quadratic_s_per_token2": self.quadratic,
                                 "floor_s": self.floor},
                "quadratic_over_linear": self.quadratic_over_linear,
                "fitted_for": dict(self.fitted_for), "fit": dict(self.fit)}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "calibration") -> CalibratedCost:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ConfigError(f"{where}: not a {FORMAT!r} file (no matching `format` key); "
                              "write one with `megascale-data profile --model`")
        if data.get("version") not in (1, VERSION):
            raise ConfigError(f"{where}: calibration version {data.get('version')!r} is not supported "
                              f"(this build reads versions 1 and {VERSION}); re-run `megascale-data profile --model`")
        coeffs = data.get("coefficients")
        keys = ("fixed_s", "linear_s_per_token", "quadratic_s_per_token2")
        if data.get("version") == VERSION:
            keys += ("per_document_s",)
        if not isinstance(coeffs, Mapping) or any(not isinstance(coeffs.get(k), (int, float)) for k in keys) or (
                not isinstance(coeffs.get("floor_s", 0.0), (int, float))):
            raise ConfigError(f"{where}: `coefficients` must hold numbers {list(keys)}, got {coeffs!r}")
        fit = dict(data.get("fit") or {})
        normal = fit.get("normal_equations")
        if isinstance(normal, Mapping) and "gram" in normal:
            gram, rhs = _upgrade_normal(np.asarray(normal["gram"], np.float64), np.asarray(normal["rhs"], np.float64))
            fit["normal_equations"] = {**normal, "gram": gram.tolist(), "rhs": rhs.tolist()}
        try:
            return cls(fixed=float(coeffs[keys[0]]), linear=float(coeffs[keys[1]]),
                       quadratic=float(coeffs[keys[2]]), per_document=float(coeffs.get("per_document_s", 0.0)),
                       floor=float(coeffs.get("floor_s", 0.0)),
                       fitted_for=dict(data.get("fitted_for") or {}), fit=fit)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def mismatches(self, **expected: Any) -> list[str]:
        """The `fitted_for` entries that differ from `expected` (e.g. device, hidden), as messages."""
        return [f"{k}: fitted for {self.fitted_for[k]!r}, used with {v!r}" for k, v in expected.items()
                if k in self.fitted_for and self.fitted_for[k] != v]


def load_calibration(path: str | Path) -> CalibratedCost:
    """Read a saved calibration; errors name the file and how to make a valid one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"calibration file {str(path)!r} does not exist; create it with "
                          "`megascale-data profile --model --model-out DIR` on the training hardware")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"calibration file {str(path)!r} is not readable JSON: {exc}") from None
    return CalibratedCost.from_dict(data, where=f"calibration file {str(path)!r}")


def _seconds(seconds: Sequence[float], n: int) -> np.ndarray:
    y = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if y.size != n:
        raise ConfigError(f"got {y.size} measured times for {n} observations; give one time per observation")
    if y.size and (not np.all(np.isfinite(y)) or y.min() <= 0):
        bad = int(np.argmax(~np.isfinite(y) | (y <= 0)))
        raise ConfigError(f"measured time of observation {bad} must be finite and > 0 seconds, got {y[bad]!r}")
    return y


def fit_calibration(observations: Sequence[Microbatches], seconds: Sequence[float], *,
                    fitted_for: Mapping[str, Any] | None = None) -> tuple[CalibratedCost, CalibrationReport]:
    """Fit the non-negative coefficients to measured times; return the model and its in-sample report.

    Args:
        observations: Each a list of microbatches, each a list of document lengths.
        seconds: Measured time of each observation.
        fitted_for: Hardware and model shape the measurements come from (saved with the fit).

    Raises:
        ConfigError: fewer than 3 observations, mismatched lengths, or invalid values.
    """
    if len(observations) < MIN_OBSERVATIONS:
        raise ConfigError(f"a calibration needs at least {MIN_OBSERVATIONS} observations (got {len(observations)}); "
                          "time more microbatches with varied document lengths")
    y = _seconds(seconds, len(observations))
    rows = [_microbatch_rows(obs, where=f"observation {i}") for i, obs in enumerate(observations)]
    a = np.stack([r.sum(axis=0) for r in rows])  # each observation's `features`
    if np.linalg.matrix_rank(a / np.maximum(np.abs(a).max(axis=0), 1e-300)) < 2:
        raise ConfigError("the observations do not vary (same microbatch shape each time); time microbatches "
                          "with different token counts and document lengths")
    none = _fit_above_floor(rows, y, 0.0)
    # the floor: candidates from the observed per-microbatch times; the best kept only when clearly better than none
    candidates = np.unique(np.quantile(y / a[:, 0], np.linspace(0.0, 1.0, min(FLOOR_CANDIDATES, len(y)))))
    best = min((_fit_above_floor(rows, y, float(f)) for f in candidates), key=lambda fit: fit[4])
    if best[4] >= FLOOR_GAIN * none[4]:
        best = none
    floor, coeffs, gram, rhs, _objective, predicted = best
    if not any(bool((r @ coeffs < floor).any()) for r in rows):
        floor = 0.0  # no microbatch sits on it: the additive model
    model = CalibratedCost(fixed=coeffs[0], per_document=coeffs[1], linear=coeffs[2], quadratic=coeffs[3],
                           floor=floor, fitted_for=dict(fitted_for or {}))
    report = CalibrationReport(measured=y, predicted=predicted)
    on_floor = sum(int((r @ coeffs < floor).sum()) for r in rows)
    # The normal equations let an OnlineCalibrator continue from this fit as from its observations.
    model.fit = {**report.to_dict(), "microbatches_on_floor": on_floor,
                 "normal_equations": {"gram": gram.tolist(), "rhs": rhs.tolist(), "weight": float(len(y))}}
    return model, report


#: Floors tried by `fit_calibration`, and how much better (squared relative error) one must fit than none.
FLOOR_CANDIDATES = 48
FLOOR_GAIN = 0.8


def _fit_above_floor(rows: list[np.ndarray], y: np.ndarray, floor: float
                     ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, float, np.ndarray]:
    """Device terms fitted to the microbatches above `floor`, the rest counted at the floor
    (alternating until the split is stable): (floor, coefficients, gram, rhs, Σ relative error², predicted)."""
    bound = [np.zeros(len(r), dtype=bool) for r in rows]
    w = 1.0 / y
    for _ in range(8):
        a = np.stack([r[~b].sum(axis=0) for r, b in zip(rows, bound, strict=True)])
        rest = y - floor * np.array([b.sum() for b in bound], dtype=np.float64)
        aw = a * w[:, None]
        gram, rhs = aw.T @ aw, aw.T @ (rest * w)
        coeffs = _solve(gram, rhs, float(len(y)))
        new = [r @ coeffs < floor for r in rows]
        if all(np.array_equal(n, b) for n, b in zip(new, bound, strict=True)):
            break
        bound = new
    predicted = np.array([_on_floor(r @ coeffs, floor).sum() for r in rows])
    return floor, coeffs, gram, rhs, float(np.sum(((predicted - y) * w) ** 2)), predicted


@dataclass(slots=True, kw_only=True)
class OnlineCalibrator:
    """Refits the calibrated model from the step times a trainer reports, forgetting old steps.

    Keeps the weighted normal equations (4×4) with exponential `decay` per observation, so an
    update is O(1) and the state is a few numbers. A trainer's steps hardly separate the fixed
    term from the linear one (every step has the same m microbatches and similar token
    counts), so start from a `prior` fitted by `megascale-data profile --model`: its saved
    normal equations enter as `prior_weight` observations and fade with `decay` like any other.
    A prior without them (hand-made) is only returned until the first observation.
    Not thread-safe: one per trainer process.

    Checkpoint schema (`state_dict`): ``{"version", "gram": 4×4, "rhs": 4, "weight", "steps"}`` (a
    version 1 state, 3×3, loads with no per-document information).
    """

    prior: CalibratedCost | None = None
    decay: float = 0.98
    prior_weight: float = 16.0
    fitted_for: dict[str, Any] = field(default_factory=dict)
    _gram: np.ndarray = field(init=False, repr=False)
    _rhs: np.ndarray = field(init=False, repr=False)
    _weight: float = field(init=False, default=0.0)
    _steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"OnlineCalibrator `decay` must be in (0, 1], got {self.decay!r}")
        if self.prior_weight < 0:
            raise ConfigError(f"OnlineCalibrator `prior_weight` must be >= 0, got {self.prior_weight!r}")
        self._gram, self._rhs = np.zeros((4, 4)), np.zeros(4)
        if self.prior is None:
            return
        if not self.fitted_for:
            self.fitted_for = dict(self.prior.fitted_for)
        normal = self.prior.fit.get("normal_equations")
        if normal and self.prior_weight > 0:
            share = self.prior_weight / float(normal["weight"])
            gram, rhs = _upgrade_normal(np.asarray(normal["gram"], np.float64), np.asarray(normal["rhs"], np.float64))
            self._gram, self._rhs = gram * share, rhs * share
            self._weight = self.prior_weight

    @property
    def steps(self) -> int:
        return self._steps

    def observe(self, microbatches: Microbatches, seconds: float) -> None:
        """Add one observation: these microbatches (document lengths each) took `seconds`.

        Feed the compute time of one rank's step (forward + backward of its microbatches, before
        waiting on the DP gradient reduction); `observe_synchronous_step` takes a step time
        that already includes the wait.
        """
        x = features(microbatches, where=f"online observation {self._steps}")
        (y,) = _seconds([seconds], 1)
        xw = x / y
        self._gram = self.decay * self._gram + np.outer(xw, xw)
        self._rhs = self.decay * self._rhs + xw
        self._weight = self.decay * self._weight + 1.0
        self._steps += 1

    def observe_synchronous_step(self, ranks: Sequence[Microbatches], seconds: float) -> None:
        """A synchronous DP step waits for its slowest rank: attribute `seconds` to the rank
        the current model predicts slowest (every rank's microbatches given, e.g. gathered)."""
        if not ranks:
            raise ConfigError("observe_synchronous_step needs the microbatches of at least one rank")
        current = self.model()
        slowest = int(np.argmax(current.predict(ranks))) if current.coefficients().any() else 0
        self.observe(ranks[slowest], seconds)

    def model(self) -> CalibratedCost:
        """The current fit (the prior alone before any observation)."""
        if self._steps == 0:
            prior = self.prior or CalibratedCost(fixed=0.0, linear=0.0, quadratic=0.0)
            return CalibratedCost(fixed=prior.fixed, linear=prior.linear, quadratic=prior.quadratic,
                                  per_document=prior.per_document, floor=prior.floor, fitted_for=dict(self.fitted_for),
                                  fit={"online_steps": 0})
        x = _solve(self._gram, self._rhs, self._weight)
        return CalibratedCost(fixed=x[0], per_document=x[1], linear=x[2], quadratic=x[3],
                              floor=self.prior.floor if self.prior is not None else 0.0,
                              fitted_for=dict(self.fitted_for),
                              fit={"online_steps": self._steps, "effective_observations": self._weight,
                                   "decay": self.decay})

    def state_dict(self) -> dict[str, Any]:
        return {"version": VERSION, "gram": self._gram.tolist(), "rhs": self._rhs.tolist(),
                "weight": self._weight, "steps": self._steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version = state.get("version")
        if version not in (1, VERSION):
            raise ConfigError(f"OnlineCalibrator state version {version!r} is not 1 or {VERSION}; "
                              "start the online calibration afresh (drop its state from the checkpoint)")
        gram, rhs = np.asarray(state["gram"], np.float64), np.asarray(state["rhs"], np.float64)
        size = 3 if version == 1 else 4
        if gram.shape != (size, size) or rhs.shape != (size,):
            raise ConfigError(f"OnlineCalibrator state has shapes gram {gram.shape}, rhs {rhs.shape}; "
                              f"expected ({size}, {size}) and ({size},)")
        gram, rhs = _upgrade_normal(gram, rhs)
        self._gram, self._rhs = gram, rhs
        self._weight, self._steps = float(state["weight"]), int(state["steps"])
