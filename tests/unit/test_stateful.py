"""The save/load equivalence harness over every stateful part: resume from the start, the middle
and an epoch boundary equals an uninterrupted run; incompatible states are refused, named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext import Client, InProcessService, ServiceConfig, ServiceTopology, Stateful
from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.dataplane.mixing import FeedbackSchedule, Mixer, build_schedule
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.plan import LoaderPlan
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.sources.demo_data import make_demo_data
from tests.harness import check_save_load, epoch_boundary, refuses, saved

TREE = ClientPlaceTree.from_sizes(tp=2, pp=2, dp=2)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=9, rows=30, image_rows=12, text_sources=2,
                         image_sources=1, megatron_rows=20, max_image_patches=64)
    return [dataclasses.replace(s, truncate=True, max_tokens=1024 - (64 if s.image_column else 0)) for s in out]


def service_config(specs, **kw) -> ServiceConfig:
    base = dict(sources=specs, seed=17, samples_per_step=12, num_microbatches=2, seq_length=1024,
                strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=32)
    base.update(kw)
    return ServiceConfig(**base)


def plan_rows(planner, step: int):
    plan = planner.plan(step)
    return plan.source, plan.position, plan.bucket, plan.microbatch


def test_planner_resumes_from_start_middle_and_epoch_boundary(specs):
    cfg = service_config(specs)
    ref = InProcessService(cfg, TREE)
    cursors = [ref.planner.cursors.tolist()]
    for step in range(12):
        ref.planner.plan(step)
        cursors.append(ref.planner.cursors.tolist())
    boundary = epoch_boundary(cursors, [ld.size for ld in ref.loaders])
    assert 0 < boundary < 11
    check_save_load(lambda: InProcessService(cfg, TREE).planner, plan_rows, steps=12,
                    resume_at=[0, 5, boundary, boundary + 1])


def test_planner_refuses_another_config_or_layout_naming_each_change(specs):
    state = saved(InProcessService(service_config(specs), TREE).planner)
    other = InProcessService(service_config(specs, seed=18), ClientPlaceTree.from_sizes(tp=1, pp=2, dp=4)).planner
    refuses(other, state, "`seed` changed: saved 17, now 18", "`world` changed", "parallel layout")


class _Delivered:
    """The in-process service as one Stateful: the delivered stream of every fetching rank."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.svc = InProcessService(cfg, TREE)

    def step(self, step: int):
        out = []
        for rank in self.svc.topology.fetch_ranks():
            for j in range(self.svc.config.num_microbatches):
                batch, info = self.svc.get(step, j, rank)
                out.append((rank, info["samples"], batch["tokens"] if "tokens" in batch else batch["labels"]))
        return out

    def state_dict(self):
        return self.svc.planner.state_dict()

    def load_state_dict(self, state):
        self.svc.planner.load_state_dict(state)


def test_service_delivers_the_same_tokens_after_a_resume(specs):
    cfg = service_config(specs)
    assert isinstance(_Delivered(cfg), Stateful)
    check_save_load(lambda: _Delivered(cfg), _Delivered.step, steps=8, resume_at=[0, 3, 7])


def test_source_loader_stream_position(specs):
    spec = specs[0]
    per_step = 7

    def make() -> SourceLoader:
        loader = SourceLoader(0, spec, seed=5, shuffle=True)

        def plan(step: int, source: int) -> LoaderPlan:
            pos = np.arange(step * per_step, (step + 1) * per_step, dtype=np.int64)
            return LoaderPlan(step=step, source=source, positions=pos, indices=loader.indices_at(pos),
                              bucket=np.zeros(per_step, dtype=np.int64))

        loader.get_plan = plan
        return loader

    def advance(loader: SourceLoader, step: int):
        got = loader.fetch(step, [0])["samples"]
        return [(pos, sample.index, sample.tokens) for _, pos, sample in got] + [loader.next_position]

    size = make().size
    boundary = size // per_step  # the step whose positions cross into epoch 2
    check_save_load(make, advance, steps=boundary + 3, resume_at=[0, 2, boundary])
    other = SourceLoader(0, spec, seed=6, shuffle=True)
    refuses(other, saved(make()), "`seed` changed: saved 5, now 6")


def test_a_source_loader_in_storage_order_draws_its_window_shuffle_and_refuses_another_order(specs):
    """``shuffle_window`` changes the stream: its loader draws `epoch_permutation` over the
    source's blocks, and a state saved under a global shuffle is refused by name (and back)."""
    import dataclasses

    from megascale_data_ext.dataplane.epoch_order import epoch_permutation

    spec = dataclasses.replace(specs[0], shuffle_window=8)
    loader = SourceLoader(0, spec, seed=5, shuffle=True)
    blocks = loader.source.blocks() if hasattr(loader.source, "blocks") else None
    expected = epoch_permutation(loader.size, seed=5, source_id=0, epoch=1, window=8, blocks=blocks)
    assert np.array_equal(loader.indices_at(np.arange(loader.size, 2 * loader.size)), expected)
    refuses(loader, saved(SourceLoader(0, specs[0], seed=5)), "shuffle_window")
    refuses(SourceLoader(0, specs[0], seed=5), saved(loader), "shuffle_window")


NAMES = ("a", "b", "c")


@pytest.mark.parametrize("mode", ["deterministic", "random"])
@pytest.mark.parametrize("schedule", [
    {"type": "constant", "weights": [1.0, 2.0, 3.0]},
    {"type": "ramp", "start": [1.0, 0.0, 1.0], "end": [0.0, 1.0, 1.0], "warmup_steps": 6},
])
def test_mixer(schedule, mode):
    def make() -> Mixer:
        return Mixer(build_schedule(schedule, source_names=NAMES), NAMES, seed=3, mode=mode)

    def advance(m: Mixer, step: int):
        counts = m.counts(step, 10 + step % 3)
        return counts, m.order(step, counts)

    check_save_load(make, advance, steps=10, resume_at=[0, 4, 9])


def test_feedback_schedule_and_its_mixer():
    def make() -> Mixer:
        return Mixer(FeedbackSchedule([1, 1, 1], lr=0.7, smoothing=0.5, min_weight=0.05, source_names=NAMES),
                     NAMES, seed=3)

    def advance(m: Mixer, step: int):
        m.schedule.report_loss(step, {"a": 1.0 + step % 2, "b": 2.0, "c": 0.5 + 0.1 * step})
        return m.counts(step, 12), m.schedule.weights(step)

    check_save_load(make, advance, steps=8, resume_at=[0, 3, 7])


class FakeSource:
    """A MicrobatchSource: microbatch (step, j) of rank r holds tokens [[step, j, r]]."""

    def get(self, step: int, microbatch: int, rank: int):
        t = np.asarray([[step, microbatch, rank]], dtype=np.int64)
        return {"tokens": t, "labels": t + 1}, {"step": step, "microbatch": microbatch}


def topology(tree: ClientPlaceTree) -> ServiceTopology:
    n = tree.buckets("DP").num_buckets
    return ServiceTopology(tree=tree, distribution=Distribution(), constructor_groups=tuple((b,) for b in range(n)),
                           num_sources=1, namespace="t")


def test_client_data_position():
    topo = topology(ClientPlaceTree.from_sizes(dp=2))

    def make() -> Client:
        return Client(topo, 1, source=FakeSource(), num_microbatches=3)

    check_save_load(make, lambda c, _i: c.next_microbatch()["tokens"], steps=10, resume_at=[0, 4, 6])
    other = Client(topo, 1, source=FakeSource(), num_microbatches=4)
    refuses(other, saved(make()), "`num_microbatches` changed: saved 3, now 4", "data.num_microbatches")


# -- fault tolerance: what a restarted actor recovers from ------------------------------------
def test_planner_checkpoints_per_step_replay_identical_plans_after_a_restart(specs, tmp_path):
    """A Planner restored from the state file of any kept step re-plans exactly the plans it had made."""
    import json

    from megascale_data_ext.runtime.checkpoints import PlannerCheckpoints
    from megascale_data_ext.state import plain

    cfg = service_config(specs)
    ckpt = PlannerCheckpoints(tmp_path, keep=4)
    ref = InProcessService(cfg, TREE).planner
    ref.on_planned = lambda plan, seconds: ckpt.save(ref.state_dict())
    ckpt.save(ref.state_dict())
    for step in range(8):
        ref.plan(step)
    assert ckpt.steps() == [5, 6, 7, 8]  # the newest `keep`, older ones pruned
    assert ckpt.at(2) is None and ckpt.latest()["step"] == 8
    assert not list(tmp_path.glob(".*.tmp"))  # written through a rename
    # the fingerprint is written once, named by each step's file, and put back when read
    assert json.loads((tmp_path / "planner-0000000008.json").read_text())["fingerprint"] == "fingerprint.json"
    assert ckpt.at(5)["fingerprint"] == plain(ref.fingerprint()) == PlannerCheckpoints(tmp_path).at(6)["fingerprint"]
    restarted = InProcessService(cfg, TREE).planner
    restarted.load_state_dict(ckpt.at(5))  # the rewind of a constructor rebuilding step 5
    for step in (5, 6, 7):
        for a, b in zip(plan_rows(restarted, step), plan_rows(ref, step), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_shadow_group_reads_what_its_primary_hands_out_and_stages_nothing(specs):
    """A shadow (``direct``) answers any ask with the primary's samples, from the plan alone; a
    primary asked again for buckets it popped (a constructor rebuilding) reads them again."""
    from megascale_data_ext.dataplane.partitioner import ShardRef
    from megascale_data_ext.runtime.loader_group import LoaderGroup

    def plan_of(step, source):
        pos = np.arange(step * 6, step * 6 + 6)
        return LoaderPlan(step=step, source=source, positions=pos,
                          indices=SourceLoader(source, specs[source], seed=3).indices_at(pos),
                          bucket=np.array([0, 1, 0, 1, 1, 0]))

    members = [(ShardRef(source=0, shard=0, num_shards=1), specs[0]), (ShardRef(source=1, shard=0, num_shards=1),
                                                                        specs[1])]
    primary = LoaderGroup(members, seed=3, get_plan=plan_of, read_ahead=0)
    shadow = LoaderGroup(members, seed=3, get_plan=plan_of, direct=True)
    key = lambda out: [(b, p, s.index, s.tokens.tolist()) for b, p, s in out["samples"]]  # noqa: E731
    for step in range(3):
        got, twin = primary.fetch_many(step, [0, 1], [1]), shadow.fetch_many(step, [0, 1], [1])
        assert {s: key(v) for s, v in got.items()} == {s: key(v) for s, v in twin.items()}
        assert all(len(v["samples"]) == 3 for v in got.values())
        assert key(primary.fetch(1, step, [1])) == key(got[1])  # popped before: read again, the same
    assert primary.rereads == 3 and all(st["staged_steps"] == 3 for st in primary.stats().values())
    assert all(st["staged_steps"] == 0 and st["samples_read"] == 0 for st in shadow.stats().values())


def test_reading_buckets_from_the_plan_equals_popping_them(specs):
    """What a shadow (or a restarted loader) reads straight from the plan is what the primary stages."""
    from megascale_data_ext.runtime.failover import missing_buckets, read_buckets

    plan = LoaderPlan(step=0, source=0, positions=np.arange(6), indices=SourceLoader(0, specs[0], seed=3).indices_at(
        np.arange(6)), bucket=np.array([0, 1, 0, 1, 1, 0]))
    primary = SourceLoader(0, specs[0], seed=3, get_plan=lambda step, source: plan)
    shadow = SourceLoader(0, specs[0], seed=3)
    popped = primary.fetch(0, [1])
    direct = read_buckets(shadow, plan, [1])
    key = lambda out: [(b, p, s.index, s.tokens.tolist()) for b, p, s in out["samples"]]  # noqa: E731
    assert key(direct) == key(popped) and len(direct["samples"]) == 3
    assert missing_buckets(plan, [1], primary.fetch(0, [1])) == [1]  # popped before: read again
    assert missing_buckets(plan, [0], primary.fetch(0, [0])) == []


def test_fault_schedules_parse_and_bad_entries_are_named():
    from megascale_data_ext.errors import ConfigError
    from megascale_data_ext.runtime.fault_injection import FaultInjector, parse_faults
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig

    specs = parse_faults("planner@every15, loader:0-4@10;constructor:1@7")
    assert [(s.component, s.indices, s.at, s.every) for s in specs] == [
        ("planner", (0,), None, 15), ("loader", (0, 1, 2, 3, 4), 10, None), ("constructor", (1,), 7, None)]
    killed = []
    inj = FaultInjector(specs, lambda c, i: killed.append((c, i)))
    for step in [0, 7, 7, 10, 15, 30]:  # a step seen twice fires once
        inj.on_step(step)
    assert killed == [("constructor", 1)] + [("loader", i) for i in range(5)] + [("planner", 0)] * 2
    assert (inj.kills("loader"), inj.kills("planner")) == (5, 2)
    with pytest.raises(ConfigError, match=r"\['planner:1@3', 'disk@4', 'loader@every0'\]"):
        parse_faults("planner:1@3,disk@4,loader@every0")
    with pytest.raises(ConfigError, match="(?s)`fault_tolerance.retries`.*`fault_tolerance.hedge_s`"):
        FaultToleranceConfig(retries=0, hedge_s=0)


def test_elastic_resume_restamps_only_the_layout(specs):
    from megascale_data_ext.errors import ResumeError
    from megascale_data_ext.runtime.elastic import reshard_planner_state

    dp4 = InProcessService(service_config(specs), ClientPlaceTree.from_sizes(dp=4)).planner
    dp4.plan(2)
    dp2 = InProcessService(service_config(specs, num_microbatches=4), ClientPlaceTree.from_sizes(dp=2)).planner
    state = dp4.state_dict(3)
    with pytest.raises(ResumeError, match="`world` changed"):
        dp2.load_state_dict(state)
    dp2.load_state_dict(reshard_planner_state(state, dp2.fingerprint()))
    assert dp2.next_step == 3 and dp2.cursors.tolist() == dp4.cursors.tolist()
    same = sorted(zip(*(a.tolist() for a in plan_rows(dp4, 3)[:2]), strict=True))
    assert sorted(zip(*(a.tolist() for a in plan_rows(dp2, 3)[:2]), strict=True)) == same  # same samples, new split


def test_planner_recovery_restores_rewinds_concurrently_and_names_a_missing_state(specs, tmp_path):
    """`PlannerRecovery` (the Planner actor's logic, without Ray): a restarted Planner continues from
    the newest saved state; a dropped plan is re-planned from the state before it, the same for
    every thread that asks at once; a step saved nowhere is one error naming checkpoint_keep."""
    import threading

    from megascale_data_ext.errors import ResumeError
    from megascale_data_ext.runtime.checkpoints import PlannerCheckpoints
    from megascale_data_ext.runtime.planner_recovery import PlannerRecovery

    cfg = service_config(specs)
    ref = InProcessService(cfg, TREE).planner
    want = {step: plan_rows(ref, step) for step in range(30)}

    def recovered(restarted: bool) -> PlannerRecovery:
        planner = InProcessService(cfg, TREE).planner
        rec = PlannerRecovery(planner, PlannerCheckpoints(tmp_path, keep=64), restarted=restarted, reports_kept=8)
        planner.on_planned = lambda plan, seconds: rec.planned()
        return rec

    first = recovered(restarted=False)
    for step in range(12):
        first.plan(step)
    again = recovered(restarted=True)  # the process died after planning step 11
    assert again.restored_from == 12 and again.planner.next_step == 12
    for step in range(12, 30):  # goes on where it was, and its kept window moves past step 0
        np.testing.assert_equal(plan_rows(again, step), want[step])
    with pytest.raises(ResumeError):
        again.planner.plan(2)  # dropped from the Planner's own window
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: got.setdefault(i, plan_rows(again, 2 + i % 2))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, rows in got.items():  # a constructor rebuilding steps 2 and 3 from six threads at once
        np.testing.assert_equal(rows, want[2 + i % 2])
    assert again.rewinds >= 1
    PlannerCheckpoints(tmp_path).clear()  # the states are gone (another disk, a cleaned directory)
    with pytest.raises(ResumeError, match="checkpoint_keep"):
        again.plan(0)


def test_plain_is_exactly_a_json_round_trip():
    """`plain` builds the JSON-normal copy directly (the Planner stamps a state every step): the
    same values and types as ``json.loads(json.dumps(...))``, and a copy, not the input."""
    import enum
    import json

    from megascale_data_ext.state import Fingerprint, StateSchema, plain

    class Level(enum.IntEnum):
        HIGH = 3

    class Mode(str, enum.Enum):
        FAST = "fast"

    def round_trip(value):
        return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))

    cases = [1, 1.5, "a", None, True, (1, 2), [1, (2, 3)], {"a": (1,)}, {1: 2, 2.5: 3, False: 4, None: 5},
             np.arange(4), np.float32(1.25), np.int64(7), {"k": np.zeros((2, 2))}, Level.HIGH, Mode.FAST,
             {"e": [Level.HIGH, Mode.FAST]}, object, float("inf"), [np.bool_(True)],
             {"nested": {"x": [np.array([1.5, 2.5]), (np.int32(3),)]}}]
    for value in cases:
        got, want = plain(value), round_trip(value)
        assert json.dumps(got) == json.dumps(want) and type(got) is type(want), (value, got, want)
    src = {"a": [1, [2]]}
    out = plain(src)
    out["a"][1].append(3)
    assert src == {"a": [1, [2]]}
    # a Fingerprint is stamped as it is (made JSON-normal once); any other mapping is copied
    fp = Fingerprint.of({"names": ("x", "y")})
    schema = StateSchema("t", 1, ("n",))
    assert schema.stamp(fp, n=(1,))["fingerprint"] is fp and fp == {"names": ["x", "y"]}
    assert schema.stamp({"names": ("x",)}, n=1) == {"kind": "t", "version": 1, "fingerprint": {"names": ["x"]}, "n": 1}
