"""Placement without a cluster: node names (label, resource, id), the options each kind of name
gets, homes read back from options, which actors are away from a home that is back, and the
actor table's text form."""

from __future__ import annotations

import pytest
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, NodeLabelSchedulingStrategy

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime import placement as pl
from megascale_data_ext.runtime.actor_table import format_table
from megascale_data_ext.runtime.config import PlacementConfig, ServiceConfig
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.sources.base import SourceSpec


AA, BB, CC, DD = (c * 56 for c in "abcd")  # Ray node ids: 28 bytes in hex


def _node(nid: str, *, alive=True, label=None, resource=None, cpus=4.0):
    res = {"CPU": cpus, "memory": 8e9, **({f"msd_node:{resource}": 1.0} if resource else {})}
    return {"NodeID": nid, "Alive": alive, "Resources": res, "Labels": {"ray.io/node-id": nid,
                                                                      **({"msd-node": label} if label else {})}}


@pytest.fixture
def nodes(monkeypatch):
    monkeypatch.setattr(pl.ray, "nodes", lambda: [
        _node(AA, label="trainer-0"), _node(BB, resource="trainer-1"), _node(CC),
        _node(DD, alive=False, label="trainer-2")])
    return pl.ClusterNodes.discover()


def test_nodes_are_named_by_label_then_resource_then_id_and_only_labels_are_homes(nodes):
    assert nodes.ids == {"trainer-0": AA, "trainer-1": BB, CC: CC}  # the dead node is not offered
    assert nodes.labelled == {"trainer-0"}
    assert nodes.name_of(BB) == "trainer-1" and nodes.name_of(DD) is None
    assert [n.name for n in nodes.resources] == [CC, "trainer-0", "trainer-1"]


def test_a_labelled_node_gets_a_label_preference_others_node_affinity_and_home_of_reads_it_back(nodes):
    labelled = nodes.on_node("trainer-0")
    assert isinstance(labelled["scheduling_strategy"], NodeLabelSchedulingStrategy)
    assert labelled["num_cpus"] == pl.AFFINITY_CPUS  # Ray ignores soft placement of 0-CPU actors
    assert pl.home_of(labelled) == "trainer-0"
    by_resource = nodes.on_node("trainer-1")
    assert isinstance(by_resource["scheduling_strategy"], NodeAffinitySchedulingStrategy)
    assert by_resource["scheduling_strategy"].soft and pl.home_of(by_resource) is None
    hard = nodes.on_node("trainer-0", soft=False)  # hard: pinned to this node id, no label preference
    assert isinstance(hard["scheduling_strategy"], NodeAffinitySchedulingStrategy)
    assert not hard["scheduling_strategy"].soft and pl.home_of(hard) is None
    assert pl.home_of({}) is None and pl.home_of({"scheduling_strategy": "SPREAD"}) is None
    with pytest.raises(ConfigError, match="trainer-9"):
        nodes.on_node("trainer-9")


def test_away_from_home_lists_alive_actors_off_a_labelled_home_that_is_alive(nodes):
    rows = [
        {"role": "constructor/0", "home": "trainer-0", "node_id": AA, "state": "ALIVE"},  # home
        {"role": "constructor/1", "home": "trainer-0", "node_id": CC, "state": "ALIVE"},  # away: move it
        {"role": "loader/0", "home": "trainer-0", "node_id": CC, "state": "RESTARTING"},  # Ray is on it
        {"role": "loader/1", "home": "trainer-1", "node_id": CC, "state": "ALIVE"},  # home named by resource
        {"role": "loader/2", "home": "trainer-2", "node_id": CC, "state": "ALIVE"},  # home is down
        {"role": "planner", "home": None, "node_id": CC, "state": "ALIVE"},  # no home
    ]
    assert [r["role"] for r in pl.away_from_home(rows, nodes)] == ["constructor/1"]


def test_constructor_homes_are_the_nodes_of_the_ranks_they_serve():
    spec = SourceSpec(name="a", format="jsonl", paths=["/nonexistent.jsonl"])
    cfg = ServiceConfig(sources=[spec], samples_per_step=8, num_microbatches=2, seq_length=256)
    topo = ServiceTopology.of(cfg, ClientPlaceTree.from_sizes(dp=4))
    groups = [sorted({r for b in g for r in topo.fetchers(b)}) for g in topo.constructor_groups]
    homes = pl.constructor_homes(["n0", "n1"], 2, topo)
    assert homes == [["n0", "n1"][min(g) // 2] for g in groups]
    assert pl.constructor_homes([], 2, topo) == [None] * topo.num_constructors


def test_move_back_seconds_is_checked():
    assert PlacementConfig(move_back_s=0).problems() == []
    for bad in (-1, "10", True):
        assert [k for k, _ in PlacementConfig(move_back_s=bad).problems()] == ["move_back_s"]


def test_actor_table_text_has_one_aligned_line_per_actor():
    rows = [{"role": "planner", "state": "ALIVE", "pid": 11, "node": None, "node_id": "f" * 56, "home": None,
             "restarts": 0, "serves": []},
            {"role": "constructor/0", "state": "ALIVE", "pid": 12345, "node": "trainer-0", "home": "trainer-0",
             "restarts": 2, "serves": [0, 1]}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["role", "state", "pid", "node", "home", "restarts", "serves"]
    assert lines[1].split() == ["planner", "ALIVE", "11", "f" * 12, "-", "0", "-"]
    assert lines[2].split() == ["constructor/0", "ALIVE", "12345", "trainer-0", "trainer-0", "2", "0,1"]
    assert len({ln.index(ln.split()[1]) for ln in lines[1:]}) == 1  # columns aligned
