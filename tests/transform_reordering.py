"""Shared harness for transformation reordering (paper Sec. 4, ``decode_images="constructor"``):
the VLM example's service config twice, once decoding images in the Source Loaders and once in
the Data Constructors, and everything a trainer receives from either, for comparison."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.config import compose_config, load_config
from megascale_data_ext.runtime.client import MicrobatchSource
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.sources.demo_data import make_demo_data

VLM_SIZES = {"tp": 1, "pp": 2, "dp": 2}
"""The VLM example's parallelism (examples/pretrain_vlm.py under 4 processes)."""


def make_vlm_demo_data(root: Path, rows: int = 48) -> Path:
    """The sources conf/sources/demo_vlm.yaml points at (text-0, coyo-0, coyo-1), small."""
    make_demo_data(root, seed=5, rows=rows, image_rows=rows, text_sources=1, image_sources=2,
                   megatron_source=False)
    return root


def vlm_example_config(data_root: Path, decode_images: str, *overrides: str) -> ServiceConfig:
    """conf/train_vlm.yaml's service config (with Hydra `overrides`) with every image source
    decoding at `decode_images`."""
    cfg = load_config(compose_config([f"data.data_root={data_root}", *overrides], "train_vlm").data)
    cfg = cfg.to_service_config()
    sources = [dataclasses.replace(s, decode_images=decode_images) if s.image_column else s for s in cfg.sources]
    assert any(s.image_column for s in sources)
    return dataclasses.replace(cfg, sources=sources)


def deliveries(source: MicrobatchSource, topology: ServiceTopology, steps: int, num_microbatches: int, *,
               encoder: bool = True) -> dict[tuple, Any]:
    """Every microbatch of every fetching rank for `steps` steps, and with `encoder` (a hybrid
    strategy) every rank's encoder share."""
    out: dict[tuple, Any] = {}
    for step in range(steps):
        for rank in topology.fetch_ranks():
            for j in range(num_microbatches):
                out[("microbatch", step, rank, j)] = source.get(step, j, rank)
        for rank in range(topology.tree.world_size if encoder else 0):
            out[("encoder", step, rank)] = source.get_encoder_images(step, rank)
    return out


def assert_identical(got: dict[tuple, Any], want: dict[tuple, Any]) -> None:
    """Same keys, and every array of every delivery equal (dtype and shape included)."""
    assert got.keys() == want.keys()
    images = 0
    for key, w in want.items():
        g = got[key]
        if key[0] == "microbatch":
            (gb, gi), (wb, wi) = g, w
            assert gb.keys() == wb.keys() and gi.keys() == wi.keys(), key
            for name in wb:
                _same(gb[name], wb[name], (*key, name))
            for name in wi.keys() - {"lead"}:  # the constructor's lead at delivery depends on timing, not data
                _same(np.asarray(gi[name]), np.asarray(wi[name]), (*key, "info", name))
            images += len(wb.get("image_seqlens", ()))
        else:
            for name, a, b in zip(("patches", "seqlens", "keys"), g, w, strict=True):
                _same(a, b, (*key, name))
    assert images > 0, "the compared steps hold no image: the check would be vacuous"


def _same(a: np.ndarray, b: np.ndarray, where: tuple) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, a.shape, b.dtype, b.shape)
    assert np.array_equal(a, b), where
