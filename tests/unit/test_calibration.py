"""Calibrated cost model: the fit recovers known coefficients, round-trips as JSON, updates
online, resolves through `get_cost_model`, and names the problem in bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megascale_data_ext.dataplane.balancers import balance_step
from megascale_data_ext.dataplane.calibration import (
    CalibratedCost,
    OnlineCalibrator,
    features,
    fit_calibration,
    load_calibration,
)
from megascale_data_ext.dataplane.costs import get_cost_model
from megascale_data_ext.errors import ConfigError

# The H100 figures of issue 8 in seconds: 19 ms per microbatch, ratio quadratic/linear 7.97e-5.
TRUE = CalibratedCost(fixed=0.019, linear=4.0e-5, quadratic=4.0e-5 * 7.97e-5)


def _packs(rng: np.random.Generator, n: int, cap: int = 8192) -> list[list[list[int]]]:
    """n single-microbatch observations: packs of 1..32 documents, from one long to many short."""
    out = []
    for _ in range(n):
        docs = rng.integers(1, 33)
        lens = rng.dirichlet(np.full(docs, 0.5)) * rng.integers(cap // 8, cap + 1)
        out.append([np.maximum(1, lens.astype(np.int64)).tolist()])
    return out


def test_fit_recovers_known_coefficients_under_noise() -> None:
    rng = np.random.default_rng(0)
    obs = _packs(rng, 80)
    clean = TRUE.predict(obs)
    model, report = fit_calibration(obs, clean * rng.lognormal(0.0, 0.02, len(obs)), fitted_for={"device": "test"})
    np.testing.assert_allclose(model.coefficients(), TRUE.coefficients(), rtol=0.08)
    assert model.quadratic_over_linear == pytest.approx(7.97e-5, rel=0.1)
    assert report.pearson_r > 0.99 and report.mean_abs_pct_error < 3.0
    assert model.fit["observations"] == 80 and model.fitted_for == {"device": "test"}
    exact, exact_report = fit_calibration(obs, clean)
    np.testing.assert_allclose(exact.coefficients(), TRUE.coefficients(), rtol=1e-6)
    assert exact_report.max_abs_pct_error < 1e-4
    assert "Pearson r" in report.format() and "| 0 |" in report.format()


def test_fit_keeps_coefficients_non_negative() -> None:
    # Times that fall with tokens would need a negative linear term: NNLS clamps it to 0.
    obs = [[[100]], [[200]], [[400]], [[800]]]
    model, _ = fit_calibration(obs, [0.05, 0.04, 0.03, 0.02])
    assert model.linear == 0.0 and model.quadratic == 0.0 and model.fixed > 0
    # Pure FLOPs-like data (no fixed term) gives fixed == 0, not a small negative number.
    flops = CalibratedCost(fixed=0.0, linear=1e-4, quadratic=1e-8)
    obs = _packs(np.random.default_rng(1), 30)
    fitted, _ = fit_calibration(obs, flops.predict(obs))
    assert fitted.fixed == pytest.approx(0.0, abs=1e-9)
    np.testing.assert_allclose(fitted.coefficients()[1:], flops.coefficients()[1:], rtol=1e-6)


def test_step_observations_sum_their_microbatches() -> None:
    step = [[100, 50], [300], []]
    assert features(step).tolist() == [3.0, 3.0, 450.0, 100**2 + 50**2 + 300**2]
    assert TRUE.predict([step])[0] == pytest.approx(sum(TRUE.microbatch_seconds(mb) for mb in step))
    # rank_seconds: the same from per-bin sums; an empty bin pays no fixed term.
    got = TRUE.rank_seconds(np.array([[150, 300, 0]]), np.array([[100**2 + 50**2, 300**2, 0]]))
    assert got[0] == pytest.approx(TRUE.predict([step[:2]])[0])


def test_save_load_round_trip_and_cost_model_registry(tmp_path) -> None:
    model, _ = fit_calibration(_packs(np.random.default_rng(2), 12), np.linspace(0.02, 0.2, 12),
                               fitted_for={"device": "cpu", "hidden": 64})
    path = model.save(tmp_path / "run" / "calibration.json")
    loaded = load_calibration(path)
    np.testing.assert_array_equal(loaded.coefficients(), model.coefficients())
    assert loaded.fitted_for == {"device": "cpu", "hidden": 64} and loaded.fit == model.fit
    assert loaded.mismatches(device="cuda", hidden=64) == ["device: fitted for 'cpu', used with 'cuda'"]
    cost = get_cost_model(f"calibrated:{path}")
    assert isinstance(cost, CalibratedCost)
    lens = np.array([10, 1000, 4000])
    np.testing.assert_allclose(cost(lens), model.linear * lens + model.quadratic * lens**2)
    # The balancers take it like any cost model.
    res = balance_step(cost(lens), tokens=lens, num_buckets=2, num_microbatches=1, cap=5000)
    assert sorted(res.bin_tokens.ravel().tolist()) == [1010, 4000]


def test_online_updates_move_a_profiled_prior_to_the_truth() -> None:
    rng = np.random.default_rng(3)
    elsewhere = CalibratedCost(fixed=0.004, linear=8.0e-5, quadratic=1e-9)  # profiled on other hardware
    packs = _packs(rng, 24)
    prior, _ = fit_calibration(packs, elsewhere.predict(packs))
    online = OnlineCalibrator(prior=prior, decay=0.97, prior_weight=8.0)
    np.testing.assert_array_equal(online.model().coefficients(), prior.coefficients())
    held_out = [[docs for obs in _packs(rng, 4) for docs in obs] for _ in range(40)]

    def error() -> float:
        return float(np.mean(np.abs(online.model().predict(held_out) / TRUE.predict(held_out) - 1)))

    errors = {0: error()}
    for step in range(1, 151):
        rank = [docs for obs in _packs(rng, 4) for docs in obs]  # one rank's 4 microbatches
        online.observe(rank, float(TRUE.predict([rank])[0] * rng.lognormal(0.0, 0.02)))
        if step in (20, 150):
            errors[step] = error()
    assert errors[0] > 0.5 and errors[20] < errors[0] / 5 and errors[150] < 0.01  # the prior fades, data rules
    got = online.model().coefficients()
    np.testing.assert_allclose(got[[0, 2, 3]], TRUE.coefficients()[[0, 2, 3]], rtol=0.2)
    # Steps of 4 microbatches hardly tell a per-document cost from the rest: what it takes is < 1 % of a step.
    assert got[1] * 4 * 16 < 0.01 * float(TRUE.predict(held_out).mean())
    # Its state round-trips (what a trainer checkpoint would hold).
    again = OnlineCalibrator(prior=prior, decay=0.97, prior_weight=8.0)
    again.load_state_dict(json.loads(json.dumps(online.state_dict())))
    np.testing.assert_allclose(again.model().coefficients(), online.model().coefficients())
    assert again.steps == 150


def test_synchronous_step_is_attributed_to_the_slowest_rank() -> None:
    online = OnlineCalibrator(prior=TRUE)  # a hand-made prior: only used to pick the slowest rank
    ranks = [[[100]], [[8000]], [[200, 200]]]
    seconds = float(TRUE.predict([ranks[1]])[0])
    online.observe_synchronous_step(ranks, seconds)
    np.testing.assert_allclose(online.state_dict()["rhs"], features(ranks[1]) / seconds)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: fit_calibration([[[10]], [[20]]], [0.1, 0.2]), "at least 3 observations"),
    (lambda: fit_calibration([[[10]]] * 3, [0.1, 0.1, 0.1]), "do not vary"),
    (lambda: fit_calibration([[[10]], [[20]], [[30]]], [0.1, 0.2]), "2 measured times for 3 observations"),
    (lambda: fit_calibration([[[10]], [[20]], [[30]]], [0.1, 0.0, 0.3]), "observation 1 must be finite and > 0"),
    (lambda: fit_calibration([[[10]], [[-5]], [[30]]], [0.1, 0.2, 0.3]), "observation 1, microbatch 0"),
    (lambda: features([]), "at least one microbatch"),
    (lambda: CalibratedCost(fixed=-1.0, linear=0.0, quadratic=0.0), "`fixed`=-1.0"),
    (lambda: OnlineCalibrator(decay=0.0), "`decay` must be in"),
    (lambda: get_cost_model("calibrated:"), "names no file"),
])
def test_bad_input_names_the_problem(call, match) -> None:
    with pytest.raises(ConfigError, match=match):
        call()


def test_bad_files_name_the_file_and_the_fix(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.json.*does not exist.*profile --model"):
        get_cost_model(f"calibrated:{tmp_path / 'missing.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.json.*not readable JSON"):
        load_calibration(bad)
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ConfigError, match=r"bad\.json.*not a 'megascale-data calibration' file"):
        load_calibration(bad)
    data = TRUE.to_dict()
    data["coefficients"]["linear_s_per_token"] = "fast"
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"bad\.json.*`coefficients` must hold numbers"):
        load_calibration(bad)
    data = TRUE.to_dict()
    data["version"] = 99
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="version 99 is not supported"):
        load_calibration(bad)


def test_a_per_document_cost_is_fitted_and_version_1_fits_and_states_still_load(tmp_path) -> None:
    """Packs of many short documents cost more than their tokens say (per-document kernels): the
    fit finds that term; files and online states written before it had one load with it at 0."""
    truth = CalibratedCost(fixed=0.019, per_document=2e-4, linear=4.0e-5, quadratic=3.2e-9)
    obs = _packs(np.random.default_rng(4), 80)
    model, _ = fit_calibration(obs, truth.predict(obs))
    np.testing.assert_allclose(model.coefficients(), truth.coefficients(), rtol=1e-6)
    without, report = fit_calibration(obs, CalibratedCost(fixed=0.019, linear=4.0e-5, quadratic=3.2e-9).predict(obs))
    assert without.per_document < 1e-12 and report.max_abs_pct_error < 1e-4
    assert truth(np.array([0, 100]))[0] == pytest.approx(2e-4)  # what a balancer charges each sample
    old = model.to_dict()
    old["version"] = 1
    del old["coefficients"]["per_document_s"]
    gram = np.asarray(old["fit"]["normal_equations"]["gram"])
    old["fit"]["normal_equations"]["gram"] = gram[np.ix_([0, 2, 3], [0, 2, 3])].tolist()
    old["fit"]["normal_equations"]["rhs"] = np.asarray(old["fit"]["normal_equations"]["rhs"])[[0, 2, 3]].tolist()
    (tmp_path / "v1.json").write_text(json.dumps(old))
    loaded = load_calibration(tmp_path / "v1.json")
    assert loaded.per_document == 0.0 and loaded.linear == model.linear
    online = OnlineCalibrator(prior=loaded)  # its 3-term normal equations become 4-term ones
    online.observe(obs[0], float(truth.predict([obs[0]])[0]))
    assert online.model().coefficients().shape == (4,)
    state = online.state_dict()
    v1_state = {"version": 1, "gram": np.asarray(state["gram"])[np.ix_([0, 2, 3], [0, 2, 3])].tolist(),
                "rhs": np.asarray(state["rhs"])[[0, 2, 3]].tolist(), "weight": state["weight"], "steps": 1}
    OnlineCalibrator().load_state_dict(v1_state)


def test_a_launch_bound_floor_is_found_and_kept_out_of_the_device_terms(tmp_path) -> None:
    """Below the host's launch time a microbatch takes the same time whatever its tokens (an H100 at
    hidden 2048: every pack up to ~4,000 tokens 38-52 ms). The fit finds that floor and fits the
    device terms to the packs above it; an additive fit would smear the floor into `fixed` and
    halve the per-token slope, so the balancer would weigh long documents wrongly."""
    from megascale_data_ext.commands._profile_model import profile_packs

    truth = CalibratedCost(fixed=0.004, linear=7.0e-6, quadratic=4.0e-10, floor=0.040)
    rng = np.random.default_rng(5)
    obs = [[p] for p in profile_packs(8192)] + _packs(rng, 40)
    model, report = fit_calibration(obs, truth.predict(obs) * rng.lognormal(0.0, 0.02, len(obs)))
    assert model.floor == pytest.approx(0.040, rel=0.08)
    assert model.linear == pytest.approx(7.0e-6, rel=0.25) and report.mean_abs_pct_error < 3.0
    assert model.fit["microbatches_on_floor"] > 0
    held_out = _packs(np.random.default_rng(6), 30)
    assert np.max(np.abs(model.predict(held_out) / truth.predict(held_out) - 1)) < 0.08
    additive = CalibratedCost(fixed=model.fixed, linear=model.linear, quadratic=model.quadratic)
    small = [[[100] * 10]]  # 1,000 tokens: on the floor
    assert model.predict(small)[0] == pytest.approx(model.floor) and additive.predict(small)[0] < model.floor
    # a rank's time sums its microbatches, each at least the floor; an empty bin pays nothing
    per_bin = model.rank_seconds(np.array([[1000, 8000, 0]]), np.array([[100_000, 8000**2, 0]]))
    assert per_bin[0] == pytest.approx(model.floor + model.microbatch_seconds([8000]))
    loaded = load_calibration(model.save(tmp_path / "floor.json"))
    assert loaded.floor == model.floor
    # without a floor in the times the fit adds none (the additive model, exactly)
    plain, _ = fit_calibration(obs, CalibratedCost(fixed=0.004, linear=7.0e-6, quadratic=4.0e-10).predict(obs))
    assert plain.floor == 0.0 and plain.linear == pytest.approx(7.0e-6, rel=1e-6)
