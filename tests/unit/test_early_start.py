"""trainer.early_start: what rank 0 launched before importing torch is handed to the training loop
only for the same config, layout and state; anything else is stopped, never left running.
(The launch itself, with real actors, runs in tests/integration/test_example_app.py.)"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.trainer import early_start
from megascale_data_ext.trainer.early_start import Launched


class FakeService:
    def __init__(self):
        self.stopped = 0
        self.started_with: list = []

    def stop(self):
        self.stopped += 1

    def start_in_background(self, *, state):
        self.started_with.append(state)
        return "future"


@pytest.fixture(autouse=True)
def no_launches():
    early_start._LAUNCHED.clear()
    yield
    early_start._LAUNCHED.clear()


TREE = ClientPlaceTree.from_sizes(tp=2, pp=2, world_size=8)


def launched(label="", config=("cfg", 1), tree=TREE, state=None, failure=None) -> FakeService:
    service = FakeService()
    early_start._LAUNCHED[label] = Launched(service, config, tree.layout(), state, failure)
    return service


def test_the_same_config_layout_and_state_are_handed_over_and_waited_for_with_the_launched_state():
    state = {"step": 4, "planner": [1, 2]}
    service = launched(state=state)
    got = early_start.take("", ("cfg", 1), TREE, {"step": 4, "planner": [1, 2]})
    assert got == (service, "future")
    assert service.started_with == [state] and service.started_with[0] is state and service.stopped == 0
    assert early_start.take("", ("cfg", 1), TREE, state) is None  # taken once


@pytest.mark.parametrize("config, tree, state", [
    (("cfg", 2), TREE, None),  # another service config
    (("cfg", 1), ClientPlaceTree.from_sizes(tp=2, pp=1, world_size=8), None),  # another layout
    (("cfg", 1), TREE, {"step": 2}),  # another resume state
])
def test_anything_else_is_stopped_and_the_loop_starts_its_own(config, tree, state):
    service = launched()
    assert early_start.take("", config, tree, state) is None
    assert service.stopped == 1 and service.started_with == []


def test_a_failed_launch_is_handed_over_as_its_exception_for_every_rank_to_learn():
    err = RuntimeError("source 'web' cannot open")
    service = launched(failure=err)
    assert early_start.take("", ("cfg", 1), TREE, None) == (service, err)
    assert service.stopped == 0


def test_what_the_run_did_not_take_is_stopped():
    train, valid = launched(), launched(label=early_start.VALIDATION_LABEL)
    failed = launched(label="other", failure=RuntimeError("x"))
    early_start.take("", ("cfg", 1), TREE, None)
    early_start.stop_unclaimed()
    assert (train.stopped, valid.stopped, failed.stopped) == (0, 1, 0)
    assert early_start._LAUNCHED == {}


def test_other_ranks_and_configs_it_cannot_read_launch_nothing(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    early_start.launch(OmegaConf.create({}))
    monkeypatch.setenv("RANK", "0")
    early_start.launch(OmegaConf.create({"parallel": {}}))  # no data node: the loop reports it, not this
    assert early_start._LAUNCHED == {}
