"""Schedule hooks with a fake schedule over a real Client fed by a fake source (no process groups)."""

from __future__ import annotations

import sys
import types

import pytest

pipeline_parallel = pytest.importorskip("megatron.core.pipeline_parallel")

import numpy as np  # noqa: E402

from megascale_data_ext import Client, ClientPlaceTree, ServiceTopology  # noqa: E402
from megascale_data_ext.dataplane.distribution import Distribution  # noqa: E402
from megascale_data_ext.errors import ConfigError, ResumeError  # noqa: E402
from megascale_data_ext.megatron.hooks import Installation, install  # noqa: E402
from tests.harness import check_save_load  # noqa: E402


class StepSource:
    """Microbatch j of step s holds tokens [[s, j]]."""

    def get(self, step, microbatch, rank):
        return {"tokens": np.asarray([[step, microbatch]])}, {"step": step, "microbatch": microbatch}


def FakeClient(num_microbatches=3):  # noqa: N802 - a real Client over a fake source
    tree = ClientPlaceTree.from_sizes(dp=1)
    topo = ServiceTopology(tree=tree, distribution=Distribution(), constructor_groups=((0,),), num_sources=1,
                           namespace="t")
    return Client(topo, 0, source=StepSource(), num_microbatches=num_microbatches)


def as_ids(batches):
    return [{"step": int(b["tokens"][0, 0]), "mb": int(b["tokens"][0, 1])} for b in batches]


class Cfg:
    variable_seq_lengths = False


class Chunk:
    def __init__(self):
        self.config = Cfg()


def fake_schedule(**kwargs):
    seen = {"varlen": [c.config.variable_seq_lengths for c in kwargs["model"]]}
    its = kwargs["data_iterator"]
    its = its if isinstance(its, list) else [its]
    seen["same"] = len(its) > 1 and its[0] is its[-1]
    seen["none"] = [it is None for it in its]
    first = next(it for it in its if it is not None)  # on a rank only one data chunk reads
    seen["batches"] = [[next(first) for _ in range(kwargs["num_microbatches"])]]
    return seen


@pytest.fixture
def patched_megatron(monkeypatch):
    def getter(pp_size=None, vp_size=None):
        return fake_schedule

    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", getter)
    user = types.ModuleType("user_training_script")
    user.get_forward_backward_func = getter
    untouched = types.ModuleType("unrelated")
    untouched.get_forward_backward_func = lambda: "someone else's"
    monkeypatch.setitem(sys.modules, "user_training_script", user)
    monkeypatch.setitem(sys.modules, "unrelated", untouched)
    return getter, user, untouched


def test_install_feeds_each_call_one_step_and_is_reversible(patched_megatron):
    getter, user, untouched = patched_megatron
    inst = install(FakeClient(), start_step=5)
    model = [Chunk()]
    out = user.get_forward_backward_func()(forward_step_func=None, data_iterator=iter(()), model=model,
                                           num_microbatches=3, seq_length=64, micro_batch_size=1)
    assert out["varlen"] == [True]  # set for the call
    assert model[0].config.variable_seq_lengths is False  # and restored after
    assert as_ids(out["batches"][0]) == [{"step": 5, "mb": j} for j in range(3)]
    out = pipeline_parallel.get_forward_backward_func()(model=model, num_microbatches=3, data_iterator=None)
    assert as_ids(out["batches"][0])[0]["step"] == 6
    assert inst.step == 7 and inst.state_dict() == inst.client.state_dict()
    assert (inst.state_dict()["step"], inst.state_dict()["microbatch"]) == (7, 0)
    assert untouched.get_forward_backward_func() == "someone else's"
    inst.uninstall()
    assert user.get_forward_backward_func is getter and pipeline_parallel.get_forward_backward_func is getter


def test_vpp_chunks_get_shared_iterator_on_data_chunks_only(patched_megatron):
    for pp_rank, pp_size, want in ((0, 2, [False, True, True]), (1, 2, [True, True, False]),
                                   (0, 1, [False, True, False])):
        inst = install(FakeClient(), num_model_chunks=3, pp_rank=pp_rank, pp_size=pp_size)
        try:
            out = pipeline_parallel.get_forward_backward_func()(model=[Chunk(), Chunk(), Chunk()], num_microbatches=3,
                                                                data_iterator=None)
            assert out["none"] == want
            assert as_ids(out["batches"][0]) == [{"step": 0, "mb": j} for j in range(3)]
        finally:
            inst.uninstall()


def test_wrong_microbatch_count_and_bad_state_are_refused(patched_megatron):
    inst = install(FakeClient())
    try:
        with pytest.raises(ConfigError, match="data.num_microbatches"):
            pipeline_parallel.get_forward_backward_func()(model=[Chunk()], num_microbatches=4, data_iterator=None)
        with pytest.raises(ResumeError, match="data_position"):
            inst.load_state_dict({"step": 3})
        state = inst.state_dict()
        inst.load_state_dict({**state, "step": 3})
        assert inst.step == 3
    finally:
        inst.uninstall()


def test_installation_state_resumes_the_schedule_feed():
    """The harness over the hooks: a schedule call per step, resumed from the saved data position."""

    def make():
        return Installation(FakeClient(), num_model_chunks=1)

    def call(inst, _i):
        out = inst.wrap(fake_schedule)(model=[Chunk()], num_microbatches=3, data_iterator=None)
        return as_ids(out["batches"][0])

    check_save_load(make, call, steps=6, resume_at=[0, 2, 5])


def test_a_chunk_that_reads_nothing_still_advances_the_position():
    inst = Installation(FakeClient(), num_model_chunks=2, pp_rank=1, pp_size=3)  # middle rank: no chunk reads
    out = inst.wrap(fake_schedule_no_read)(model=[Chunk(), Chunk()], num_microbatches=3, data_iterator=None)
    assert out == [True, True] and inst.step == 1


def fake_schedule_no_read(**kwargs):
    return [it is None for it in kwargs["data_iterator"]]


class ValidSource:
    """The validation service: microbatch j of step s holds tokens [[1000 + s, j]]."""

    def get(self, step, microbatch, rank):
        return {"tokens": np.asarray([[1000 + step, microbatch]])}, {"step": step, "microbatch": microbatch}


def test_evaluation_calls_are_fed_by_the_validation_client_and_never_by_the_training_stream(patched_megatron):
    topo = FakeClient().topology
    valid = Client(topo, 0, source=ValidSource(), num_microbatches=2)
    valid.seek(4)  # a resumed run continues its validation stream where it was
    inst = install(FakeClient(), start_step=2, valid_client=valid)
    try:
        schedule = pipeline_parallel.get_forward_backward_func()
        train = schedule(model=[Chunk()], num_microbatches=3, data_iterator=None)
        assert as_ids(train["batches"][0]) == [{"step": 2, "mb": j} for j in range(3)]
        for want in (4, 5):  # each evaluation call: the validation stream's next step, its own microbatch count
            out = schedule(model=[Chunk()], num_microbatches=3, data_iterator=None, forward_only=True)
            assert as_ids(out["batches"][0]) == [{"step": 1000 + want, "mb": j} for j in range(2)]
            assert out["varlen"] == [True]
        assert inst.step == 3 and valid.step == 6  # training position moved only by the training call
        train = schedule(model=[Chunk()], num_microbatches=3, data_iterator=None)
        assert as_ids(train["batches"][0])[0]["step"] == 3
    finally:
        inst.uninstall()


def test_without_a_validation_client_evaluation_runs_on_the_callers_iterators(patched_megatron):
    inst = install(FakeClient())
    try:
        mine = iter([{"tokens": np.asarray([[-1, j]])} for j in range(3)])
        out = pipeline_parallel.get_forward_backward_func()(model=[Chunk()], num_microbatches=3, data_iterator=mine,
                                                            forward_only=True)
        assert as_ids(out["batches"][0]) == [{"step": -1, "mb": j} for j in range(3)]
        assert inst.step == 0  # the training stream was not touched
    finally:
        inst.uninstall()
