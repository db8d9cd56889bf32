"""Mixing schedules and the Mixer: weights over time, validation, count accuracy, resumption."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megascale_data_ext.dataplane.mixing import (
    ConstantSchedule,
    FeedbackSchedule,
    LinearRampSchedule,
    Mixer,
    MixingSchedule,
    PiecewiseSchedule,
    apportion,
    build_schedule,
)
from megascale_data_ext.errors import ConfigError, PlanError, ResumeError

NAMES = ["web", "code", "math"]


def _random_weights(seed: int, n: int = 10) -> np.ndarray:
    w = np.random.default_rng(seed).random(n)
    return w / w.sum()


def _greedy(deficit: np.ndarray, batch_size: int, eligible: np.ndarray) -> np.ndarray:
    """Reference: Megatron's one-sample-at-a-time rule (largest remaining deficit, first index on ties)."""
    counts = np.zeros(deficit.size, dtype=np.int64)
    for _ in range(batch_size):
        counts[int(np.argmax(np.where(eligible, deficit - counts, -np.inf)))] += 1
    return counts


def _megatron_helpers() -> ModuleType:
    """Megatron's compiled ``helpers_cpp``, loaded without importing megatron.core (4 s of torch imports)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    found = sorted(Path(next(iter(spec.submodule_search_locations)), "core", "datasets").glob("helpers_cpp*.so"))
    if not found:
        pytest.skip("megatron-core's helpers_cpp extension is not built")
    ext = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(ext)  # type: ignore[arg-type]
    ext.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# --------------------------------------------------------------------------- schedules


def test_constant_schedule_normalises_and_returns_copies() -> None:
    s = ConstantSchedule([2.0, 1.0, 1.0])
    np.testing.assert_array_equal(s.weights(0), [0.5, 0.25, 0.25])
    s.weights(0)[0] = 99.0
    assert s.weights(7)[0] == 0.5 and s.weights(7).dtype == np.float64
    assert isinstance(s, MixingSchedule) and s.num_sources == 3


def test_piecewise_schedule_switches_exactly_at_step_boundaries() -> None:
    s = PiecewiseSchedule([0, 100, 250], [[1, 0, 0], [0, 1, 1], [1, 1, 2]])
    expected = {0: [1, 0, 0], 99: [1, 0, 0], 100: [0, 0.5, 0.5], 249: [0, 0.5, 0.5], 250: [0.25, 0.25, 0.5],
                10**7: [0.25, 0.25, 0.5]}
    for step, w in expected.items():
        np.testing.assert_array_equal(s.weights(step), w, err_msg=f"step {step}")
    assert [s.phase(t) for t in (0, 99, 100, 250)] == [0, 0, 1, 2]


def test_piecewise_schedule_in_epochs() -> None:
    s = PiecewiseSchedule([0, 1.5, 3], [[1, 0], [0, 1], [1, 1]], unit="epoch", steps_per_epoch=10)
    np.testing.assert_array_equal(s.start_steps, [0, 15, 30])
    assert s.weights(14).tolist() == [1, 0] and s.weights(15).tolist() == [0, 1]
    assert s.weights(30).tolist() == [0.5, 0.5]


def test_linear_ramp_interpolates_between_mixtures() -> None:
    s = LinearRampSchedule([1, 0], [1, 3], warmup_steps=100, start_step=20)
    np.testing.assert_allclose(s.weights(0), [1, 0])
    np.testing.assert_allclose(s.weights(20), [1, 0])
    np.testing.assert_allclose(s.weights(70), [0.625, 0.375])  # halfway between [1, 0] and [0.25, 0.75]
    np.testing.assert_allclose(s.weights(120), [0.25, 0.75])
    np.testing.assert_allclose(s.weights(10**6), [0.25, 0.75])
    jump = LinearRampSchedule([1, 0], [0, 1], warmup_steps=0, start_step=5)
    assert jump.weights(4).tolist() == [1, 0] and jump.weights(5).tolist() == [0, 1]


# --------------------------------------------------------------------------- validation


def test_bad_weights_name_the_sources_and_show_the_value() -> None:
    with pytest.raises(ConfigError) as err:
        ConstantSchedule([0.5, -1.0, 0.5], source_names=NAMES)
    assert "`weights` must be non-negative and sum to > 0, got [0.5, -1.0, 0.5]" in str(err.value)
    assert "sources: ['web', 'code', 'math']" in str(err.value)
    for bad in ([0.0, 0.0, 0.0], [1.0, float("nan"), 1.0], [1.0, float("inf"), 1.0]):
        with pytest.raises(ConfigError, match="must be non-negative and sum to > 0"):
            ConstantSchedule(bad, source_names=NAMES)
    with pytest.raises(ConfigError, match=r"`weights` has 2 entries but there are 3 sources.*'math'"):
        ConstantSchedule([1.0, 1.0], source_names=NAMES)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        LinearRampSchedule([1, -1], [0, 0], warmup_steps=-3, start_step=1.5)
    msg = str(err.value)
    assert "`start` must be non-negative" in msg and "`end` must be non-negative" in msg
    assert "`warmup_steps` must be a non-negative integer, got -3" in msg and "`start_step`" in msg
    with pytest.raises(ConfigError) as err:
        PiecewiseSchedule([5, 10], [[1, 0], [1, -2]], unit="hour")
    msg = str(err.value)
    assert "boundaries` must start at 0" in msg and "`unit` must be one of ['step', 'epoch'], got 'hour'" in msg
    assert "`weights[1]` must be non-negative" in msg
    with pytest.raises(ConfigError, match="`steps_per_epoch` must be a positive integer"):
        PiecewiseSchedule([0, 1], [[1, 0], [0, 1]], unit="epoch")
    with pytest.raises(ConfigError, match=r"`min_weight` \* \(sources with base weight > 0\) must be < 1"):
        FeedbackSchedule([1, 1, 1], min_weight=0.4)


def test_build_schedule_from_plain_dicts() -> None:
    configs = [
        {"type": "constant", "weights": [1.0, 2.0, 3.0]},
        {"type": "piecewise", "boundaries": [0, 10], "weights": [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], "unit": "step",
         "steps_per_epoch": None},
        {"type": "ramp", "start": [1.0, 0.0, 0.0], "end": [1.0, 1.0, 1.0], "warmup_steps": 8, "start_step": 2},
        {"type": "feedback", "base_weights": [1.0, 1.0, 2.0], "lr": 0.5, "smoothing": 0.8, "min_weight": 0.05,
         "delay": 2},
    ]
    for config in configs:
        schedule = build_schedule(config, source_names=NAMES)
        assert schedule.to_config() == config
        assert build_schedule(schedule.to_config()) == schedule
    by_name = build_schedule({"type": "constant", "weights": {"code": 1, "math": 3}}, source_names=NAMES)
    assert by_name.weights(0).tolist() == [0.0, 0.25, 0.75]


def test_build_schedule_errors_list_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"`type` must be one of \['constant', 'piecewise', 'ramp', 'feedback'\], "
                                          r"got 'cosine'"):
        build_schedule({"type": "cosine"})
    with pytest.raises(ConfigError) as err:
        build_schedule({"type": "ramp", "start": {"web": 1, "wiki": 2}, "warmup": 5}, source_names=NAMES)
    msg = str(err.value)
    assert "unknown keys ['warmup']" in msg and "missing key `end`" in msg and "missing key `warmup_steps`" in msg
    assert "unknown sources ['wiki'] (sources: ['web', 'code', 'math'])" in msg


def test_mixer_rejects_mismatched_sources() -> None:
    with pytest.raises(ConfigError, match=r"the schedule has 2 weights but there are 3 sources"):
        Mixer(ConstantSchedule([1, 1]), NAMES, seed=0)
    with pytest.raises(ConfigError, match=r"built for sources \['a', 'b', 'c'\]"):
        Mixer(ConstantSchedule([1, 1, 1], source_names=["a", "b", "c"]), NAMES, seed=0)
    with pytest.raises(ConfigError, match=r"`mode` must be one of \['deterministic', 'random'\], got 'roundrobin'"):
        Mixer(ConstantSchedule([1, 1, 1]), NAMES, seed=0, mode="roundrobin")
    with pytest.raises(ConfigError, match="`source_names` must be unique"):
        Mixer(ConstantSchedule([1, 1, 1]), ["a", "a", "b"], seed=0)


# --------------------------------------------------------------------------- deterministic accuracy


@pytest.mark.parametrize("batch_size", [1, 7, 100, 1000])
def test_deterministic_counts_track_constant_weights_within_one_sample(batch_size: int) -> None:
    for seed in range(5):
        w = _random_weights(seed)
        mixer = Mixer(ConstantSchedule(w), [f"s{i}" for i in range(10)], seed=seed)
        for step in range(1000 // batch_size):
            counts = mixer.counts(step, batch_size)
            assert counts.dtype == np.int64 and counts.sum() == batch_size
            assert np.abs(mixer.consumed - mixer.target).max() < 1.0
        total = (1000 // batch_size) * batch_size
        assert np.abs(mixer.consumed - total * w).max() <= 1.2


def test_deterministic_accuracy_matches_or_beats_megatron_blend() -> None:
    helpers = _megatron_helpers()
    for seed in range(10):
        w = _random_weights(seed)
        index, sample_index = np.zeros(1000, dtype=np.int16), np.zeros(1000, dtype=np.int64)
        helpers.build_blending_indices(index, sample_index, w, 10, 1000, False)
        megatron_err = np.abs(np.bincount(index, minlength=10) - 1000 * w).max()
        mixer = Mixer(ConstantSchedule(w), [f"s{i}" for i in range(10)], seed=0)
        for step in range(1000):
            mixer.counts(step, 1)
        ours = np.abs(mixer.consumed - 1000 * w).max()
        assert megatron_err <= 1.2 and ours <= 1.0 and ours <= megatron_err + 0.05


@settings(max_examples=60, deadline=None)
@given(
    # Multiples of 1/1024 keep every comparison exact (and make ties common, the interesting case).
    deficit=st.lists(st.integers(-20 * 1024, 60 * 1024).map(lambda x: x / 1024) | st.integers(-5, 20).map(float),
                     min_size=1, max_size=12),
    batch_size=st.integers(0, 80),
    mask_seed=st.integers(0, 2**16),
)
def test_apportion_equals_megatron_one_by_one_rule(deficit: list[float], batch_size: int, mask_seed: int) -> None:
    d = np.asarray(deficit)
    eligible = np.random.default_rng(mask_seed).random(d.size) < 0.8
    eligible[0] = True
    counts = apportion(d, batch_size, eligible=eligible)
    np.testing.assert_array_equal(counts, _greedy(d, batch_size, eligible))
    assert counts.sum() == batch_size and not counts[~eligible].any()


def test_apportion_on_arbitrary_floats_matches_the_rule_and_stays_within_one() -> None:
    rng = np.random.default_rng(0)
    for case in range(300):
        d = rng.normal(0, 20, int(rng.integers(1, 15))) + (rng.random() < 0.3) * rng.random() * 1e-15
        eligible = rng.random(d.size) < 0.8
        eligible[int(rng.integers(d.size))] = True
        batch_size = int(rng.integers(0, 100))
        counts = apportion(d, batch_size, eligible=eligible)
        np.testing.assert_array_equal(counts, _greedy(d, batch_size, eligible), err_msg=f"case {case}")
        held = counts > 0
        if held.any():  # optimality certificate: no unserved deficit beats a served sample by more than 1
            assert (d - counts)[eligible].max() <= (d - counts + 1)[held].min() + 1e-9


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["piecewise", "ramp"]), seed=st.integers(0, 2**16))
def test_time_varying_schedules_track_cumulative_targets(kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if kind == "piecewise":
        schedule: MixingSchedule = PiecewiseSchedule([0, 13, 40], rng.random((3, 6)).tolist())
    else:
        schedule = LinearRampSchedule(rng.random(6).tolist(), rng.random(6).tolist(), warmup_steps=30, start_step=5)
    mixer = Mixer(schedule, [f"s{i}" for i in range(6)], seed=seed)
    target = np.zeros(6)
    for step in range(60):
        batch_size = int(rng.integers(1, 64))
        counts = mixer.counts(step, batch_size)
        target += schedule.weights(step) * batch_size
        assert counts.sum() == batch_size
        np.testing.assert_allclose(mixer.target, target)
        assert np.abs(mixer.consumed - target).max() < 1.0


def test_zero_weight_sources_get_nothing_in_both_modes() -> None:
    schedule = PiecewiseSchedule([0, 5], [[1, 0, 1], [0, 1, 0]])
    for mode in ("deterministic", "random"):
        mixer = Mixer(schedule, NAMES, seed=3, mode=mode)
        early = sum(mixer.counts(step, 33) for step in range(5))
        late = sum(mixer.counts(step, 33) for step in range(5, 10))
        assert early[1] == 0 and late[0] == 0 and late[2] == 0 and late[1] == 165


# --------------------------------------------------------------------------- random mode


def test_random_mode_is_seeded_per_step() -> None:
    w = _random_weights(1, n=4)
    a = Mixer(ConstantSchedule(w), list("abcd"), seed=11, mode="random")
    b = Mixer(ConstantSchedule(w), list("abcd"), seed=11, mode="random")
    c = Mixer(ConstantSchedule(w), list("abcd"), seed=12, mode="random")
    runs = [[m.counts(step, 64) for step in range(20)] for m in (a, b, c)]
    assert all(np.array_equal(x, y) for x, y in zip(runs[0], runs[1], strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(runs[0], runs[2], strict=True))
    assert all(x.sum() == 64 for x in runs[2])
    fresh = Mixer(ConstantSchedule(w), list("abcd"), seed=11, mode="random")
    np.testing.assert_array_equal(fresh.counts(7, 64), runs[0][7])  # depends on (seed, step), not on history
    np.testing.assert_array_equal(a.order(3, runs[0][3]), b.order(3, runs[0][3]))


# --------------------------------------------------------------------------- order


@pytest.mark.parametrize("mode", ["deterministic", "random"])
def test_order_holds_exactly_the_counts(mode: str) -> None:
    mixer = Mixer(ConstantSchedule([5, 3, 2]), NAMES, seed=0, mode=mode)
    counts = mixer.counts(0, 50)
    order = mixer.order(0, counts)
    assert order.dtype == np.int32 and order.size == 50
    np.testing.assert_array_equal(np.bincount(order, minlength=3), counts)
    np.testing.assert_array_equal(order, mixer.order(0, counts))


def test_deterministic_order_interleaves_every_prefix() -> None:
    counts = np.array([13, 0, 1, 29, 7], dtype=np.int64)
    order = Mixer(ConstantSchedule([1] * 5), list("abcde"), seed=0).order(0, counts)
    prefix = np.cumsum(np.eye(5, dtype=np.int64)[order], axis=0)
    ideal = np.arange(1, counts.sum() + 1)[:, None] * counts / counts.sum()
    assert np.abs(prefix - ideal).max() <= 1.0
    with pytest.raises(PlanError, match="counts must be 5 non-negative integers"):
        Mixer(ConstantSchedule([1] * 5), list("abcde"), seed=0).order(0, np.array([1, -1, 0, 0, 0]))


@pytest.mark.parametrize("mode", ["deterministic", "random"])
def test_interleave_is_the_order_with_each_slots_rank_in_its_source(mode: str) -> None:
    """`interleave`'s rank is how many earlier slots hold the same source; its deterministic order is the
    (2j+1)/(2c) interleave with ties to the lower source, as the lexsort it replaced computed it."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        k = int(rng.integers(1, 40))
        counts = rng.integers(0, 60, k) * (rng.random(k) < 0.8)
        if trial % 5 == 0:
            counts[:] = counts.max()  # equal counts: every fraction ties across sources
        mixer = Mixer(ConstantSchedule([1] * k), [f"s{i}" for i in range(k)], seed=trial, mode=mode)
        order, rank = mixer.interleave(trial, counts)
        np.testing.assert_array_equal(order, mixer.order(trial, counts))
        seen = np.zeros(k, dtype=np.int64)
        expected = np.empty(len(order), dtype=np.int64)
        for i, s in enumerate(order.tolist()):
            expected[i], seen[s] = seen[s], seen[s] + 1
        np.testing.assert_array_equal(rank, expected, err_msg=f"trial {trial}")
        if mode == "deterministic":
            src = np.repeat(np.arange(k, dtype=np.int32), counts)
            j = np.arange(src.size) - np.repeat(np.cumsum(counts) - counts, counts)
            np.testing.assert_array_equal(order, src[np.lexsort((src, (2 * j + 1) / (2 * counts[src])))])


# --------------------------------------------------------------------------- state


def _loss_report(step: int) -> dict[int | str, float]:
    return {"web": 2.0 + 0.1 * np.sin(step), 1: 3.0 - 0.01 * step, "math": float("nan") if step % 7 == 0 else 2.5}


def _make(kind: str, mode: str) -> Mixer:
    schedule = {
        "piecewise": lambda: PiecewiseSchedule([0, 9, 21], [[1, 1, 0], [0, 2, 1], [3, 1, 1]]),
        "ramp": lambda: LinearRampSchedule([1, 0, 0], [1, 2, 3], warmup_steps=17, start_step=3),
        "feedback": lambda: FeedbackSchedule([1, 1, 1], lr=0.7, smoothing=0.5, min_weight=0.05, source_names=NAMES),
    }[kind]()
    return Mixer(schedule, NAMES, seed=5, mode=mode)


def _step(mixer: Mixer, step: int) -> tuple[list[int], list[int]]:
    counts = mixer.counts(step, 5 + (step * 7) % 23)
    order = mixer.order(step, counts)
    if isinstance(mixer.schedule, FeedbackSchedule):
        mixer.schedule.report_loss(step, _loss_report(step))
    return counts.tolist(), order.tolist()


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["piecewise", "ramp", "feedback"]), mode=st.sampled_from(["deterministic", "random"]),
       resume_at=st.integers(0, 40))
def test_resume_mid_run_equals_uninterrupted(kind: str, mode: str, resume_at: int) -> None:
    uninterrupted = _make(kind, mode)
    expected = [_step(uninterrupted, step) for step in range(40)]
    first = _make(kind, mode)
    got = [_step(first, step) for step in range(resume_at)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints may go through JSON
    resumed = _make(kind, mode)
    resumed.load_state_dict(state)
    if resume_at > 0:  # a retried plan for the last step gives the same counts again
        assert resumed.counts(resume_at - 1, 5 + ((resume_at - 1) * 7) % 23).tolist() == expected[resume_at - 1][0]
    got += [_step(resumed, step) for step in range(resume_at, 40)]
    assert got == expected
    assert json.dumps(resumed.state_dict()) == json.dumps(uninterrupted.state_dict())


def test_resume_refuses_a_changed_config() -> None:
    mixer = _make("piecewise", "deterministic")
    _step(mixer, 0)
    state = mixer.state_dict()
    with pytest.raises(ResumeError, match=r"`seed` changed: saved 5, now 6"):
        Mixer(mixer.schedule, NAMES, seed=6).load_state_dict(state)
    other = Mixer(PiecewiseSchedule([0, 10], [[1, 1, 0], [0, 2, 1]]), NAMES, seed=5)
    with pytest.raises(ResumeError, match=r"`boundaries` changed: saved \[0, 9, 21\], now \[0, 10\]"):
        other.load_state_dict(state)


def test_steps_must_be_planned_in_order() -> None:
    mixer = _make("ramp", "deterministic")
    mixer.counts(0, 8)
    with pytest.raises(PlanError, match="mixer expects step 1 next, got 3"):
        mixer.counts(3, 8)
    with pytest.raises(PlanError, match="step 0 was planned with batch_size 8, asked again with 9"):
        mixer.counts(0, 9)


# --------------------------------------------------------------------------- feedback


def test_feedback_moves_weight_toward_the_higher_loss_source() -> None:
    schedule = FeedbackSchedule([1, 1, 0], lr=1.0, smoothing=0.0, min_weight=0.1, source_names=NAMES)
    np.testing.assert_allclose(schedule.weights(0), [0.5, 0.5, 0.0])
    schedule.report_loss(0, {"web": 2.0, "code": 3.0, "math": 9.0})
    np.testing.assert_array_equal(schedule.ema_losses, [2.0, 3.0, 9.0])
    # smoothing 0: ema = loss; excess over the mean of reported sources; base 0 stays 0.
    raw = np.array([np.exp(2.0 - 14 / 3), np.exp(3.0 - 14 / 3)])
    np.testing.assert_allclose(schedule.weights(1)[:2], 0.1 + 0.8 * raw / raw.sum())
    assert schedule.weights(1)[2] == 0.0 and schedule.weights(1)[1] > schedule.weights(1)[0]
    schedule.report_loss(1, {0: 5.0, 1: 0.0})
    w = schedule.weights(2)
    assert w[0] > w[1] >= 0.1 and np.isclose(w.sum(), 1.0)


def test_feedback_is_deterministic_and_validates_reports() -> None:
    a, b = (FeedbackSchedule([1, 2, 1], lr=0.3, smoothing=0.9, source_names=NAMES) for _ in range(2))
    for step in range(50):
        a.report_loss(step, _loss_report(step))
        b.report_loss(step, _loss_report(step))
    np.testing.assert_array_equal(a.weights(50), b.weights(50))
    assert a.num_ignored == 8  # NaN losses of steps 0, 7, ..., 49 are skipped
    assert a.state_dict() == b.state_dict()
    with pytest.raises(PlanError, match="report_loss step 49 is not after the last reported step 49"):
        a.report_loss(49, {0: 1.0})
    with pytest.raises(PlanError, match=r"unknown source 'wiki'.*sources: \['web', 'code', 'math'\]"):
        a.report_loss(50, {"wiki": 1.0})
