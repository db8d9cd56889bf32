"""Transformation reordering on a real local Ray: the VLM example's service delivers the same
microbatches and encoder shares with its images decoded by the Data Constructor actors as with
them decoded by the Source Loader actors, and both are what the in-process service delivers."""

from __future__ import annotations

import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors
from megascale_data_ext.runtime.service import DataService
from tests.transform_reordering import (VLM_SIZES, assert_identical, deliveries, make_vlm_demo_data,
                                        vlm_example_config)

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_vlm_demo_data(tmp_path_factory.mktemp("vlm"))




def on_ray(cfg, tree):
    svc = DataService(cfg, tree)
    handles = svc.start()
    try:
        return deliveries(RemoteConstructors(handles.topology), handles.topology, STEPS, cfg.num_microbatches)
    finally:
        svc.stop()


def test_constructor_actors_decode_what_loader_actors_would_have(data_root, ray_local):
    tree = ClientPlaceTree.from_sizes(**VLM_SIZES)
    want_cfg = vlm_example_config(data_root, "loader")
    local = InProcessService(want_cfg, tree)
    want = deliveries(local, local.topology, STEPS, want_cfg.num_microbatches)
    for mode in ("loader", "constructor"):
        assert_identical(on_ray(vlm_example_config(data_root, mode, f"data.ray.namespace=reorder-{mode}"), tree), want)
