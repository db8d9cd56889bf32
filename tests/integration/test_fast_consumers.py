"""Consumers as fast as a GPU step, and one that stalls: every step whole, every sample once.

Each trainer rank is a thread pulling its encoder share and its microbatches as fast as they
arrive (both orders a trainer uses), with client prefetch 0 / 4 / 16, on a real local Ray
service and in one process; one run stalls a rank (10 s here; `megascale-data bench consumers`
runs a 30 s stall over 500 steps) and then races. Every rank's bytes of every step must equal
what a slow, lockstep consumer of an in-process service gets. (Before data was released on
consumption, 0 of 4 such VLM runs on Ray delivered 8 steps whole.)
"""

from __future__ import annotations

import dataclasses

import pytest

from megascale_data_ext.commands.bench_consumers import lockstep, race, step_digest
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.runtime.thread_stacks import ThreadStacks
from megascale_data_ext.sources.demo_data import make_demo_data

pytestmark = pytest.mark.slow

TREE = dict(dp=3, pp=2)
STEPS_PER_RUN = 5
STRIDE = STEPS_PER_RUN + 17  # a run's client leaves up to 16 steps requested ahead: the next run starts past them
VLM_ARGS = {"model": "gpt-tiny", "encoder_model": "vit-1b", "encoder_axis": "WORLD", "axis": "DP"}
STRATEGIES = {"vlm_balance": VLM_ARGS, "llm_balance": {"model": "gpt-tiny"}}
# the deepest client prefetch the runs use (threads are sized for it), and a lead below it, so prefetched
# requests wait for the slowest fetcher in every deep run (backpressure, not only in the stall)
FT = FaultToleranceConfig(client_prefetch=16, max_lead_steps=6)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("fast"), seed=8, rows=400, image_rows=400, text_sources=1,
                         image_sources=2, megatron_source=False, max_image_patches=64)
    return [dataclasses.replace(s, truncate=True, max_tokens=1024 - (64 if s.image_column else 0)) for s in out]




def config(specs, strategy: str) -> ServiceConfig:
    return ServiceConfig(sources=specs, seed=13, samples_per_step=12, num_microbatches=2, seq_length=1024,
                         strategy=strategy, strategy_args=dict(STRATEGIES[strategy]), buffer_size=64,
                         ray=RayConfig(namespace=f"fast-{strategy}"))


def reference(cfg, tree, steps: list[int], *, hybrid: bool) -> dict[int, dict[int, str]]:
    """The slow consumer: one process, ranks in lockstep, images first."""
    return lockstep(InProcessService(cfg, tree), steps, hybrid=hybrid, m=cfg.num_microbatches)


RUNS = {  # (images first, client prefetch): both orders, no / the default / deep prefetch for the hybrid strategy,
    # whose encoder shares failed; the text strategy (microbatches only) at the deepest prefetch
    "vlm_balance": [(True, 0), (False, 16), (True, 4), (False, 4)],
    "llm_balance": [(False, 16)],
}
STALL_S = 10.0  # `bench consumers` runs the 30 s stall over 500 steps (docs/benchmarks.md)


@pytest.mark.parametrize("strategy", ["vlm_balance", "llm_balance"])
def test_racing_ranks_on_ray_get_every_step_whole_with_any_client_prefetch(specs, ray_local, strategy):
    """One service; consecutive runs race over consecutive steps in each order and prefetch,
    the VLM one last with a rank that stalls and then races."""
    tree = ClientPlaceTree.from_sizes(**TREE)
    cfg, hybrid = config(specs, strategy), strategy == "vlm_balance"
    runs = RUNS[strategy] + ([(True, 4, (len(RUNS[strategy]) * STRIDE + 1, STALL_S))] if hybrid else [])
    ranges = [range(k * STRIDE, k * STRIDE + STEPS_PER_RUN) for k in range(len(runs))]
    want = reference(cfg, tree, [s for r in ranges for s in r], hybrid=hybrid)
    svc = DataService(cfg, tree, fault_tolerance=FT, progress=None)
    handles = svc.start()
    try:
        topo = handles.topology
        for k, (images_first, prefetch, *stall) in enumerate(runs):
            steps = ranges[k]
            got = race(lambda p=prefetch: RemoteConstructors(topo, prefetch_steps=p, fault_tolerance=FT), topo, steps,
                       images_first=images_first, hybrid=hybrid, m=cfg.num_microbatches,
                       stall=stall[0] if stall else None)
            for rank in range(tree.world_size):
                assert got[rank] == {s: want[rank][s] for s in steps}, (
                    f"rank {rank}, run {k} (images first {images_first}, prefetch {prefetch}): bytes differ")
        stats = svc.stats()["constructors"]
        lead = FT.max_lead(cfg.prefetch)
        assert all(c["lead"] is None or c["lead"] <= lead for c in stats)  # backpressure held
        if hybrid:  # the stalled rank held the others back instead of losing their data
            assert sum(c["backpressure_waits"] for c in stats) > 0
    finally:
        svc.stop()


@pytest.mark.parametrize("images_first", [True, False])
def test_racing_and_stalled_ranks_in_one_process_get_the_slow_consumers_bytes(specs, images_first):
    tree = ClientPlaceTree.from_sizes(**TREE)
    cfg = config(specs, "vlm_balance")
    want = reference(cfg, tree, list(range(2 * STEPS_PER_RUN)), hybrid=True)
    svc = InProcessService(cfg, tree, max_lead=3, wait_timeout_s=60)
    for k, stall in enumerate([None, (STEPS_PER_RUN + 1, 3.0)]):
        steps = range(k * STEPS_PER_RUN, (k + 1) * STEPS_PER_RUN)
        got = race(lambda: svc, svc.topology, steps, images_first=images_first, hybrid=True, m=cfg.num_microbatches,
                   stall=stall)
        for rank in range(tree.world_size):
            assert got[rank] == {s: want[rank][s] for s in steps}
    assert all(c.buffered_steps() <= 3 for c in svc.constructors)


def test_hybrid_cp_ranks_race_on_ray_and_each_gets_its_own_count_whole(ray_local, tmp_path):
    """strategy=hybrid_cp at DP 2 x CP 2 x PP 2: each rank its own number of microbatches, which a
    racing consumer learns from its first one; every rank's bytes equal the lockstep consumer's."""
    text = [dataclasses.replace(s, truncate=True, max_tokens=1024) for s in
            make_demo_data(tmp_path, seed=8, rows=300, text_sources=3, image_sources=0, megatron_source=False)]
    tree = ClientPlaceTree.from_sizes(dp=2, cp=2, pp=2)
    cfg = ServiceConfig(sources=text, seed=13, samples_per_step=16, num_microbatches=2, seq_length=1024,
                        strategy="hybrid_cp", strategy_args={"model": "gpt-tiny"}, buffer_size=64,
                        ray=RayConfig(namespace="fast-hybrid_cp"))
    steps = list(range(12))
    inproc = InProcessService(cfg, tree)  # each fetching rank's count of every step, from the plan
    want = lockstep(InProcessService(cfg, tree), steps, hybrid=False, m=cfg.num_microbatches)
    svc = DataService(cfg, tree, fault_tolerance=FT, progress=None)
    handles = svc.start()
    try:
        topo = handles.topology
        whole = {s: {r: inproc.constructor_of(r).get_step(s, r) for r in topo.fetch_ranks()} for s in steps}
        counts = [{r: len(mbs) for r, mbs in whole[s].items()} for s in steps]
        assert any(len(set(c.values())) > 1 for c in counts) and any(n != 2 for c in counts for n in c.values())
        for s in steps:  # the lockstep consumer took each rank's whole step, whatever its count
            assert all(want[r][s] == step_digest(mbs, None) for r, mbs in whole[s].items())
        got = race(lambda: RemoteConstructors(topo, prefetch_steps=4, fault_tolerance=FT), topo, steps,
                   images_first=True, hybrid=False, m=cfg.num_microbatches)
        for rank in range(tree.world_size):
            assert got[rank] == want[rank], f"rank {rank}: bytes differ"
    finally:
        svc.stop()


class _Busy(ThreadStacks):
    """Every default thread blocks on a plan that needs `meta` first, as a loader's fetches wait on the
    Planner while the Planner waits on the loader's summaries."""

    RAY_OPTIONS = {"num_cpus": 0, "max_concurrency": 2}
    CONCURRENCY_GROUPS = {"metadata": 1}

    def __init__(self):
        import threading

        self.answered = threading.Event()

    def fetch(self):
        return self.answered.wait(300)

    def summaries(self):
        self.answered.set()
        return "answered"


def test_a_loaders_metadata_calls_are_answered_while_every_fetch_thread_waits(ray_local):
    """The Planner's summaries run on threads of their own: with every default thread of the actor
    blocked on a fetch that needs them, they are still answered (in one pool they deadlocked until
    the Planner's 120 s timeout, run 104)."""
    import ray

    from megascale_data_ext.runtime.loader_group import METADATA_GROUP, LoaderGroupActor
    from megascale_data_ext.runtime.ray_actor import actor

    assert LoaderGroupActor.CONCURRENCY_GROUPS == {METADATA_GROUP: 2}
    for method in ("summaries", "summary_buffer"):
        assert getattr(LoaderGroupActor, method).__ray_concurrency_group__ == METADATA_GROUP
    _Busy.summaries = ray.method(concurrency_group="metadata")(_Busy.summaries)
    busy = actor(_Busy).remote()
    fetches = [busy.fetch.remote() for _ in range(2)]  # both default threads wait
    _a_caller_that_gives_up_names_where_the_threads_wait(busy)
    assert ray.get(busy.summaries.remote(), timeout=120) == "answered"
    assert ray.get(fetches, timeout=120) == [True, True]
    ray.kill(busy)


def _a_caller_that_gives_up_names_where_the_threads_wait(busy) -> None:
    """A loader call given up on (recovery timeout) raises one line, with the silent actor's thread
    stacks as a note: every service actor answers them on a thread of its own."""
    import ray
    from ray.exceptions import GetTimeoutError

    from megascale_data_ext.errors import ServiceUnavailableError
    from megascale_data_ext.runtime.actors import PlannerActor
    from megascale_data_ext.runtime.constructor_actor import DataConstructorActor
    from megascale_data_ext.runtime.failover import raise_unless_recovering
    from megascale_data_ext.runtime.loader_group import LoaderGroupActor
    from megascale_data_ext.runtime.retry import Retry

    assert all(issubclass(c, ThreadStacks) for c in (PlannerActor, DataConstructorActor, LoaderGroupActor))
    retry = Retry(120.0)
    while ray.get(busy.thread_stacks.remote(), timeout=120).count("in fetch") < 2:  # both fetches started
        assert not retry.expired(), "the actor's two fetches never both started"
        retry.pause()
    with pytest.raises(ServiceUnavailableError) as got:
        raise_unless_recovering({busy: GetTimeoutError("silent")}, ["text-0"], "answer `summaries`", Retry(0.0))
    assert "\n" not in str(got.value) and "text-0" in str(got.value)
    notes = "\n".join(got.value.__notes__)
    assert "threads of the loader of sources ['text-0']" in notes
    assert notes.count("in fetch") == 2 and "self.answered.wait(300)" in notes  # both waiting threads

