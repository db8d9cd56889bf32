"""A source file truncated or removed while the service reads it, on a real local Ray (issue 22).

``on_bad_rows: skip``: the run goes on; every planned sample of every step is either delivered
(byte-identical to the fault-free run's) or in the constructors' skip records, once. ``error``:
the trainer-side client gets one error naming the source, the file and the override. A removed
file is served from the loader's open handle until the loader restarts; the restarted loader
cannot open it and every caller learns so at once, by name, instead of waiting out
``recovery_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from megascale_data_ext.commands.bench_faults import documents
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import SourceError, root_cause
from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
from megascale_data_ext.errors import ServiceUnavailableError
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
STEPS, CUT_AT = 12, 3


def config(tmp_path, policy: str) -> ServiceConfig:
    specs = [dataclasses.replace(s, truncate=True, max_tokens=1024, on_bad_rows=policy, row_group_cache=1)
             for s in make_demo_data(tmp_path / "data", seed=7, rows=240, text_sources=2, image_sources=0,
                                     megatron_source=False, row_group_rows=16)]
    return ServiceConfig(sources=specs, seed=4, samples_per_step=8, num_microbatches=2, seq_length=1024,
                         strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=32, prefetch=1,
                         ray=RayConfig(namespace=f"file-faults-{policy}-{tmp_path.name}"),
                         autoscale=AutoscaleConfig(enabled=False),
                         fault_tolerance=FaultToleranceConfig(client_prefetch=1, rpc_timeout_s=60,
                                                              recovery_timeout_s=600))


def step_documents(get, topology, steps, m, pad_id) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for step in steps:
        docs: Counter = Counter()
        for rank in topology.fetch_ranks():
            for j in range(m):
                docs.update(documents(get(step, j, rank)[0], pad_id))
        out[step] = docs
    return out


def files_of(spec) -> list[Path]:
    return sorted(Path(spec.paths[0]).glob("*.parquet"))  # demo sources name their directory


def truncate(path: Path, keep: float) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(int(os.path.getsize(path) * keep))


def test_truncated_file_under_skip_goes_on_and_accounts_for_every_planned_sample(tmp_path, ray_local):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg = config(tmp_path, "skip")
    pad_id = load_tokenizer(cfg.sources[0]).pad_id
    ref = InProcessService(cfg, tree)
    want = step_documents(ref.get, ref.topology, range(STEPS), cfg.num_microbatches, pad_id)
    svc = DataService(cfg, tree, progress=None)
    handles = svc.start()
    try:
        client = RemoteConstructors(handles.topology, fault_tolerance=svc.ft)
        got = step_documents(client.get, handles.topology, range(CUT_AT), cfg.num_microbatches, pad_id)
        for path in files_of(cfg.sources[0]):
            truncate(path, 0.1)  # the footer was read at open; 90 % of the row groups are gone now
        got.update(step_documents(client.get, handles.topology, range(CUT_AT, STEPS), cfg.num_microbatches, pad_id))
        stats = svc.stats()
    finally:
        svc.stop()
    skipped = [rec for c in stats["constructors"] for rec in c["skipped"]]
    assert skipped, "the truncation was never noticed"
    assert len({tuple(r[:3]) for r in skipped}) == len(skipped)  # each planned sample skipped once
    assert all("cannot be read at row group" in r[3] for r in skipped)
    for step in range(STEPS):
        assert not got[step] - want[step], f"step {step}: a document the fault-free run never delivered"
        lost = sum((want[step] - got[step]).values())
        assert lost == sum(1 for r in skipped if r[0] == step), f"step {step}: {lost} missing but not reported"
    assert all(got[s] == want[s] for s in range(CUT_AT))


def test_truncated_file_under_error_is_one_named_line_at_the_client(tmp_path, ray_local):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg = config(tmp_path, "error")
    svc = DataService(cfg, tree, progress=None)
    handles = svc.start()
    try:
        client = RemoteConstructors(handles.topology, fault_tolerance=svc.ft)
        client.get(0, 0, handles.topology.fetch_ranks()[0])
        for path in files_of(cfg.sources[0]) + files_of(cfg.sources[1]):
            truncate(path, 0.1)
        with pytest.raises(Exception) as err:
            for step in range(1, STEPS):
                for rank in handles.topology.fetch_ranks():
                    client.get(step, 0, rank)
    finally:
        svc.stop()
    cause = root_cause(err.value)
    assert isinstance(cause, SourceError), repr(err.value)
    msg = str(cause)
    assert "cannot be read at row group" in msg and "`data.sources." in msg and ".on_bad_rows=skip`" in msg
    assert "\n" not in msg


def test_removed_file_is_served_until_its_loader_restarts_then_fails_at_once_by_name(tmp_path, ray_local):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg = config(tmp_path, "skip")
    svc = DataService(cfg, tree, progress=None)
    handles = svc.start()
    try:
        client = RemoteConstructors(handles.topology, fault_tolerance=svc.ft)
        ranks = handles.topology.fetch_ranks()
        for path in files_of(cfg.sources[0]):
            os.remove(path)
        for step in range(CUT_AT):  # the loader's open handle still reads it
            for rank in ranks:
                client.get(step, 0, rank)
        assert not [r for c in svc.stats()["constructors"] for r in c["skipped"]]
        loader = next(r for r in svc.actors() if r["role"].startswith("loader/") and 0 in r["serves"])
        os.kill(loader["pid"], signal.SIGKILL)  # Ray restarts it; its __init__ cannot open the file
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailableError) as err:
            for step in range(CUT_AT, STEPS + 8):
                for rank in ranks:
                    client.get(step, 0, rank)
        waited = time.monotonic() - t0
    finally:
        svc.stop()
    msg = str(root_cause(err.value))
    assert "cannot start again after a restart" in msg and f"source {cfg.sources[0].name!r}" in msg, msg
    assert waited < svc.ft.recovery_timeout_s  # named as soon as the restart failed, not at the deadline
