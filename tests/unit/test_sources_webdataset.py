"""WebDataset / Energon ``.tar`` shards as a source: samples keyed by member name, read by seek,
every sample once per epoch through the service, files going bad mid-run named."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import SourceError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.sources import ByteTokenizer, SourceSpec, open_source
from megascale_data_ext.sources.images import synthetic_jpeg
from megascale_data_ext.sources.webdataset import sample_key


def write_shard(path: Path, samples: list[dict[str, bytes]], start: int = 0) -> None:
    with tarfile.open(path, "w") as tar:
        for k, sample in enumerate(samples):
            for ext, data in sample.items():
                info = tarfile.TarInfo(f"part/{start + k:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def texts(n: int, start: int = 0) -> list[str]:
    return [f"document {start + i} " + "word " * (3 + (start + i) % 17) for i in range(n)]


@pytest.fixture
def shards(tmp_path):
    d = tmp_path / "wds"
    d.mkdir()
    write_shard(d / "shard-000.tar", [{"txt": t.encode()} for t in texts(7)])
    write_shard(d / "shard-001.tar", [{"json": json.dumps({"text": t}).encode()} for t in texts(5, 7)], start=7)
    return d


def test_member_names_group_into_samples_by_key():
    assert sample_key("a/b/0001.seg.jpg") == ("a/b/0001", "seg.jpg")
    assert sample_key("0001.TXT") == ("0001", "txt")


def test_text_from_txt_or_json_members_in_shard_order(shards):
    src = open_source(SourceSpec(name="wds", format="webdataset", paths=[str(shards)]))
    assert len(src) == 12
    got = [ByteTokenizer().decode(s.tokens[:-1].tolist()) for s in src.read(np.arange(12))]
    assert got == texts(12)
    meta = src.metadata()
    assert meta["text_tokens"].tolist() == [len(t.encode()) + 1 for t in texts(12)]  # + EOD


def test_images_travel_with_their_text_and_are_costed_from_headers(tmp_path):
    jpg = synthetic_jpeg(64, 32, seed=1)
    write_shard(tmp_path / "vl.tar", [{"txt": b"a cat", "jpg": jpg}, {"txt": b"two", "jpg": jpg, "png.jpg": jpg}])
    src = open_source(SourceSpec(name="vl", format="webdataset", paths=[str(tmp_path / "vl.tar")],
                                 image_column="image", patch_size=16))
    meta = src.metadata()
    assert meta["num_images"].tolist() == [1, 2] and meta["image_patch_counts"].tolist() == [8, 8, 8]
    assert [len(s.images) for s in src.read([0, 1])] == [1, 2]


def test_every_sample_once_per_epoch_through_the_service(shards):
    cfg = ServiceConfig(sources=[SourceSpec(name="wds", format="webdataset", paths=[str(shards)], truncate=True)],
                        seed=5, samples_per_step=4, num_microbatches=2, seq_length=256, strategy="llm_balance",
                        strategy_args={"model": "gpt-tiny"}, buffer_size=16)
    tree = ClientPlaceTree.from_sizes(dp=2)
    svc = InProcessService(cfg, tree)
    keys = []
    for step in range(6):  # 24 samples: two epochs of 12
        for rank in (0, 1):
            for mb in range(2):
                keys += [tuple(k) for k in svc.get(step, mb, rank)[1]["samples"].tolist()]
    positions = sorted(p for _, p, _ in keys)
    assert positions == list(range(24))
    by_epoch = {e: sorted(i for _, p, i in keys if p // 12 == e) for e in (0, 1)}
    assert by_epoch == {0: list(range(12)), 1: list(range(12))}


def test_a_sample_without_text_is_named_or_left_out(tmp_path):
    write_shard(tmp_path / "s.tar", [{"txt": b"fine"}, {"cls": b"3"}, {"txt": b"also fine"}])
    spec = SourceSpec(name="s", format="webdataset", paths=[str(tmp_path / "s.tar")])
    with pytest.raises(SourceError, match=r"1 of 3 samples have no text member .*on_bad_rows=skip"):
        open_source(spec)
    assert len(open_source(dataclasses.replace(spec, on_bad_rows="skip"))) == 2


def test_a_shard_truncated_mid_run_is_the_files_fault_named_once(tmp_path):
    write_shard(tmp_path / "t.tar", [{"txt": t.encode()} for t in texts(6)])
    src = open_source(SourceSpec(name="t", format="webdataset", paths=[str(tmp_path / "t.tar")],
                                 on_bad_rows="skip"))
    assert len(src.read([0])) == 1
    with open(tmp_path / "t.tar", "r+b") as fh:
        fh.truncate(1536)  # keeps the first sample's header and data only
    result = src.read_report([0, 4, 5])
    assert [s.index for s in result.samples] == [0]
    assert [s.index for s in result.skipped] == [4, 5] and "truncated" in result.skipped[0].reason


def test_info_and_lint_read_shards_by_path(shards, capsys):
    from megascale_data_ext.cli import main

    assert main(["info", str(shards), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["sources"]
    assert (row["format"], row["rows"]) == ("webdataset", 12)
    assert main(["lint", str(shards), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["wds", "webdataset", "2", "12", "0", "0"] and "lint: clean" in out
