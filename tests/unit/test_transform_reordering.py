"""Transformation reordering in one process: the VLM example with its images decoded by the Data
Constructors delivers exactly what it delivers with them decoded by the Source Loaders."""

from __future__ import annotations

import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.inprocess import InProcessService
from tests.transform_reordering import (VLM_SIZES, assert_identical, deliveries, make_vlm_demo_data,
                                        vlm_example_config)

STEPS = 3
#: The example's hybrid strategy (images to encoder ranks over WORLD), and images packed into the
#: backbone's microbatches only (no encoder plan, so nothing checks the patch counts on the way).
STRATEGIES = {"vlm_balance": (), "llm_balance": ("strategy=llm_balance", "~data.strategy.args.encoder_model")}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_vlm_demo_data(tmp_path_factory.mktemp("vlm"))


def run(data_root, decode_images, strategy):
    cfg = vlm_example_config(data_root, decode_images, *STRATEGIES[strategy])
    svc = InProcessService(cfg, ClientPlaceTree.from_sizes(**VLM_SIZES))
    return deliveries(svc, svc.topology, STEPS, cfg.num_microbatches, encoder=strategy == "vlm_balance")


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_constructor_side_decoding_delivers_what_loader_side_decoding_does(data_root, strategy):
    assert_identical(run(data_root, "constructor", strategy), run(data_root, "loader", strategy))
