"""Files that go bad while a source reads them: removed, truncated, corrupted (issue 22).

Every format, both policies: ``on_bad_rows: error`` raises one `SourceError` naming the source,
the file and the override that skips; ``skip`` skips exactly the unreadable rows (reported in
the read's ``skipped`` list and logged once each), keeps serving the readable ones and does not
spend ``max_bad_fraction`` on them. Never a crash (a truncated memory-mapped ``.bin`` would
SIGBUS the process), never a silently shorter read.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources import SourceSpec, open_source
from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

ROWS, GROUP = 60, 10


def parquet_source(tmp_path, **kw):
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": [f"document number {i} " * 3 for i in range(ROWS)]}), path,
                   row_group_size=GROUP, compression="snappy")
    return path, open_source(SourceSpec(name="web", format="parquet", paths=[str(path)], row_group_cache=1, **kw))


def truncate(path, keep: float) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(int(size * keep))


@pytest.mark.parametrize("window", [0, 4], ids=["row-groups", "windows"])
def test_truncated_parquet_under_error_names_file_and_the_override(tmp_path, window):
    path, src = parquet_source(tmp_path, shuffle_window=window)
    assert len(src.read(np.arange(GROUP))) == GROUP
    truncate(path, 0.3)  # the footer was read at open; later row groups are gone now
    with pytest.raises(SourceError) as err:
        src.read(np.arange(ROWS))
    msg = str(err.value)
    assert "source 'web'" in msg and "part-0.parquet" in msg and "cannot be read at row group" in msg
    assert "`data.sources.web.on_bad_rows=skip`" in msg and "\n" not in msg


@pytest.mark.parametrize("window", [0, 4], ids=["row-groups", "windows"])
def test_truncated_parquet_under_skip_skips_exactly_the_lost_rows_and_reports_each_once(tmp_path, window, caplog):
    path, src = parquet_source(tmp_path, on_bad_rows="skip", shuffle_window=window)
    before = src.read_report(np.arange(ROWS))
    assert len(before.samples) == ROWS and not before.skipped
    truncate(path, 0.3)
    caplog.set_level(logging.WARNING, logger="megascale_data_ext.sources.file_faults")
    first = src.read_report(np.arange(ROWS))
    again = src.read_report(np.arange(ROWS))
    for got in (first, again):
        assert len(got.samples) + len(got.skipped) == ROWS  # exact accounting: nothing silently dropped
        assert got.skipped and all(s.file_fault and "part-0.parquet" in (s.path or "") for s in got.skipped)
        good = {s.index for s in got.samples}
        assert all(before.samples[i].tokens.tolist() == s.tokens.tolist() for i, s in zip(sorted(good), got.samples))
    assert {s.index for s in first.skipped} == {s.index for s in again.skipped}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "part-0.parquet" in lines[0] and "skipped" in lines[0]  # once, not per read
    assert src.bad_sample_reasons()  # counted where lint and stats look
    assert src.file_faults.files and str(path) in src.file_faults.files


@pytest.mark.parametrize("window", [0, 4], ids=["row-groups", "windows"])
def test_corrupted_parquet_page_under_skip_loses_only_its_row_group(tmp_path, window):
    path, src = parquet_source(tmp_path, on_bad_rows="skip", shuffle_window=window)
    md = pq.ParquetFile(path).metadata
    col = md.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    start = col.data_page_offset
    data[start + 8: start + 40] = b"\xff" * 32
    path.write_bytes(bytes(data))  # same size, same footer: only row group 2's page is garbage
    got = src.read_report(np.arange(ROWS))
    assert sorted(s.index for s in got.skipped) == list(range(2 * GROUP, 3 * GROUP))
    assert len(got.samples) == ROWS - GROUP


def test_removed_parquet_is_served_from_its_open_handle_with_one_warning(tmp_path, caplog):
    path, src = parquet_source(tmp_path)
    want = [s.tokens.tolist() for s in src.read(np.arange(ROWS))]
    os.remove(path)
    caplog.set_level(logging.WARNING, logger="megascale_data_ext.sources.file_faults")
    for _ in range(2):
        assert [s.tokens.tolist() for s in src.read(np.arange(ROWS))] == want
    assert len(caplog.records) == 1 and "removed" in caplog.records[0].getMessage()
    with pytest.raises(SourceError, match="not found"):  # a restarted loader cannot reopen it, and says so
        open_source(src.spec)


def megatron_source(tmp_path, **kw):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=int(n)) for n in rng.integers(20, 80, size=ROWS)]
    prefix = write_indexed_dataset(tmp_path / "corpus", docs, vocab_size=256)
    return prefix, docs, open_source(SourceSpec(name="code", format="megatron", paths=[str(prefix)],
                                                append_eod=False, eod_token_id=0, **kw))


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_truncated_megatron_bin_never_crashes_the_reader(tmp_path, policy):
    prefix, docs, src = megatron_source(tmp_path, on_bad_rows=policy)
    truncate(prefix + ".bin", 0.5)  # the map still spans the old size: touching it past EOF would SIGBUS
    if policy == "error":
        with pytest.raises(SourceError, match=r"source 'code': '.*corpus.bin' was truncated .*on_bad_rows=skip"):
            src.read(np.arange(ROWS))
        return
    got = src.read_report(np.arange(ROWS))
    assert got.skipped and len(got.samples) + len(got.skipped) == ROWS
    assert all(s.tokens.tolist() == docs[s.index].tolist() for s in got.samples)
    assert min(s.index for s in got.skipped) > max(s.index for s in got.samples)  # the tail is what was cut


def jsonl_source(tmp_path, **kw):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(f'{{"text": "line {i} of the chat corpus"}}\n' for i in range(ROWS)))
    return path, open_source(SourceSpec(name="chat", format="jsonl", paths=[str(path)], **kw))


def test_jsonl_removed_or_truncated_mid_run(tmp_path):
    path, src = jsonl_source(tmp_path, on_bad_rows="skip")
    truncate(path, 0.5)
    got = src.read_report(np.arange(ROWS))
    assert got.skipped and all(s.file_fault for s in got.skipped)
    assert len(got.samples) + len(got.skipped) == ROWS
    os.remove(path)
    gone = src.read_report(np.arange(ROWS))
    assert len(gone.skipped) == ROWS and "cannot be opened" in gone.skipped[0].reason
    (tmp_path / "strict").mkdir()
    path, strict = jsonl_source(tmp_path / "strict")
    os.remove(path)
    with pytest.raises(SourceError, match=r"source 'chat': '.*chat.jsonl' cannot be opened .*on_bad_rows=skip"):
        strict.read(np.arange(3))


def test_file_faults_do_not_spend_the_bad_sample_budget(tmp_path):
    """``max_bad_fraction`` stays for bad rows; a file gone bad under ``skip`` never trips it."""
    path, src = parquet_source(tmp_path, on_bad_rows="skip", max_bad_fraction=0.0)
    truncate(path, 0.3)
    got = src.read_report(np.arange(ROWS))  # would raise "exceeds max_bad_fraction" if counted
    assert len(got.skipped) >= GROUP
