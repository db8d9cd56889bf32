"""Online cost-model fit from step times (trainer/step_calibration.py): each step's time is
attributed to the rank the fit predicts slowest, the fit recovers the machine's coefficients,
a saved profile fit is the prior, and calibration.json is reusable as `model: calibrated:<path>`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megascale_data_ext.dataplane.calibration import CalibratedCost, load_calibration
from megascale_data_ext.trainer.step_calibration import StepCalibration, plan_microbatches

TRUE = CalibratedCost(fixed=0.02, linear=2e-5, quadratic=4e-9)


def make_plan(rng: np.random.Generator, dp: int = 4, m: int = 2) -> SimpleNamespace:
    n = int(rng.integers(dp * m, 6 * dp * m))
    tokens = rng.choice([64, 256, 1024, 4096], size=n, p=[0.4, 0.3, 0.2, 0.1])
    return SimpleNamespace(tokens=tokens, bucket=rng.integers(0, dp, n), microbatch=rng.integers(0, m, n),
                           num_buckets=dp, num_microbatches=m)


def test_plan_microbatches_groups_document_lengths_by_rank_and_microbatch():
    plan = SimpleNamespace(tokens=np.array([5, 7, 9, 11]), bucket=np.array([0, 1, 0, 1]),
                           microbatch=np.array([0, 0, 1, 1]), num_buckets=2, num_microbatches=2)
    assert plan_microbatches(plan) == [[[5], [9]], [[7], [11]]]


def test_the_online_fit_follows_the_machine_and_is_saved_for_reuse(tmp_path):
    rng = np.random.default_rng(0)
    plans = [make_plan(rng) for _ in range(60)]
    cal = StepCalibration(lambda step: plans[step], {"model": "gpt-tiny"}, skip=1)
    for step, plan in enumerate(plans):  # a synchronous step lasts as long as its slowest rank
        seconds = max(TRUE.predict(plan_microbatches(plan))) * (1 + 0.01 * rng.standard_normal())
        cal.observe(step, 5.0 if step == 0 else seconds)  # step 0 (start-up) is left out
    predicted, measured = cal.comparison()
    assert len(measured) == 59 and np.all(measured < 5.0)
    assert np.mean(np.abs(predicted - measured) / measured) < 0.05
    line = cal.report()
    assert "from 59 steps" in line and "predicted" in line and "measured" in line
    path = cal.save(tmp_path)
    fitted = load_calibration(path)
    assert fitted.linear == pytest.approx(TRUE.linear, rel=0.3) and fitted.quadratic == pytest.approx(TRUE.quadratic,
                                                                                                     rel=0.3)
    assert (tmp_path / "calibration_online.json").exists()

    prior = StepCalibration(lambda step: plans[step], {"model": f"calibrated:{path}"})
    assert prior.online.model().linear == pytest.approx(fitted.linear)  # the saved fit is the starting point
    assert "no step fitted" in prior.report()


def test_a_requested_plan_is_fetched_once_and_resolved_after_the_step():
    rng = np.random.default_rng(1)
    plan = make_plan(rng)
    calls = []

    def plan_of(step):
        calls.append(step)
        return lambda: plan  # a round trip resolved later

    cal = StepCalibration(plan_of, {}, skip=0)
    cal.request(0)
    cal.observe(0, 0.5)
    cal.observe(1, 0.6)  # not requested: fetched when observed
    assert calls == [0, 1] and cal.online.steps == 2 and cal.steps[0][0] == plan_microbatches(plan)
