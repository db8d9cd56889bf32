"""Bad input: clear errors naming source + file (+ row), and the skip-and-count tolerance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascale_data_ext.errors import ConfigError, SourceError
from megascale_data_ext.sources import SourceSpec, formats, open_source, registry
from megascale_data_ext.sources.images import synthetic_jpeg


def _spec(path, **kw) -> SourceSpec:
    return SourceSpec(name="src", format="parquet", paths=[str(path)], **kw)


def _good(tmp_path, name="good.parquet", n=8):
    path = tmp_path / name
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(n)]}), path, row_group_size=3)
    return path


def test_missing_file_glob_and_directory(tmp_path):
    with pytest.raises(SourceError, match=r"source 'src': file '.*nope.parquet' not found"):
        open_source(_spec(tmp_path / "nope.parquet"))
    with pytest.raises(SourceError, match=r"glob '.*\*.parquet' matches no files"):
        open_source(_spec(tmp_path / "*.parquet"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(SourceError, match=r"directory '.*empty_dir' holds no .parquet"):
        open_source(_spec(tmp_path / "empty_dir"))


@pytest.mark.parametrize("damage", ["bad_magic", "truncated", "zero_bytes"])
def test_corrupt_parquet_names_file(tmp_path, damage):
    good = _good(tmp_path).read_bytes()
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(
        {"bad_magic": b"JUNK" + good[4:-4] + b"JUNK", "truncated": good[: len(good) // 2], "zero_bytes": b""}[damage]
    )
    with pytest.raises(SourceError) as err:
        open_source(_spec(tmp_path))  # directory: good file opens, bad one fails
    assert (
        "source 'src'" in str(err.value)
        and "bad.parquet" in str(err.value)
        and "corrupt or truncated" in str(err.value)
    )


def test_missing_column_lists_existing(tmp_path):
    pq.write_table(pa.table({"caption": ["a"], "jpg": [b"x"]}), tmp_path / "x.parquet")
    with pytest.raises(SourceError) as err:
        open_source(_spec(tmp_path / "x.parquet", image_column="jpg"))
    msg = str(err.value)
    assert (
        "has no column(s) ['text']" in msg
        and "['caption', 'jpg']" in msg
        and "x.parquet" in msg
        and "text_column" in msg
    )


@pytest.mark.parametrize(("table", "kw", "fragment"), [
    ({"text": [1, 2]}, {}, "column 'text' is int64, expected a string"),
    ({"text": ["a", "b"], "jpg": ["not", "bytes"]}, {"image_column": "jpg"}, "column 'jpg' is string, expected binary"),
    ({"text": ["a", "b"], "num_tokens": [1.5, 2.0]}, {}, "column 'num_tokens' is double, expected an integer"),
])
def test_a_column_of_the_wrong_type_is_named_at_open(tmp_path, table, kw, fragment):
    """Found when the source opens (one line naming file, column and type), not as a traceback from the first read."""
    pq.write_table(pa.table(table), tmp_path / "x.parquet")
    with pytest.raises(SourceError, match=r"source 'src': file '.*x.parquet': " + fragment.replace("'", ".")):
        open_source(_spec(tmp_path / "x.parquet", **kw))


def test_empty_source(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(SourceError, match=r"source 'src' is empty: 0 rows in 1 file.*point `data.sources.src.paths` at "
                                          r"data, or remove the source"):
        open_source(_spec(tmp_path / "e.parquet"))


def _image_rows(tmp_path, bad_rows: set[int], n=10):
    ims = [b"\x89PNG broken" if i in bad_rows else synthetic_jpeg(32, 48, seed=i) for i in range(n)]
    path = tmp_path / "imgs.parquet"
    pq.write_table(pa.table({"text": [f"c{i}" for i in range(n)], "image": ims}), path, row_group_size=4)
    return path


def test_undecodable_image_zero_tolerance_raises(tmp_path):
    src = open_source(_spec(_image_rows(tmp_path, {6}), image_column="image"))
    assert src.metadata()["image_patch_counts"][6] == 0  # header unreadable: no cost, read() skips
    src.read([0, 1])
    with pytest.raises(SourceError) as err:
        src.read([5, 6])
    msg = str(err.value)
    assert "1 bad samples out of 4 read exceeds max_bad_fraction=0.0" in msg
    assert "cannot decode image" in msg and "file=" in msg and "imgs.parquet" in msg and "row=6" in msg


def test_skip_and_count_within_tolerance(tmp_path):
    src = open_source(_spec(_image_rows(tmp_path, {2, 7}), image_column="image", max_bad_fraction=0.25))
    report = src.read_report(np.arange(8)[::-1])
    assert [s.index for s in report.samples] == [6, 5, 4, 3, 1, 0]
    assert [(s.index, s.row) for s in report.skipped] == [(7, 7), (2, 2)]
    assert len(report.samples) + len(report.skipped) == 8
    assert all("imgs.parquet" in s.path and "cannot decode image" in s.reason for s in report.skipped)
    assert [s.index for s in src.bad_samples] == [7, 2] and src.samples_read == 8
    assert src.bad_sample_reasons() == {
        "image 0: cannot decode image: UnidentifiedImageError: cannot identify image file": 2
    }
    with pytest.raises(SourceError, match="3 bad samples out of 9 read"):
        src.read([2])  # the same bad row again: 3 > 0.25 * 9


def test_too_long_sample_within_tolerance_is_planned_capped_and_skipped(tmp_path):
    pq.write_table(pa.table({"text": ["short", "x" * 50, "ok"]}), tmp_path / "t.parquet")
    src = open_source(_spec(tmp_path / "t.parquet", max_tokens=16, max_bad_fraction=0.5))
    assert src.metadata()["text_tokens"].tolist() == [6, 16, 3]  # capped: the planner can place it
    report = src.read_report([0, 1, 2])
    assert [s.index for s in report.samples] == [0, 2]
    (skip,) = report.skipped
    assert "51 tokens > max_tokens=16" in skip.reason and "truncate=true" in skip.reason and skip.row == 1


def test_too_long_sample_refused_at_metadata_naming_the_keys(tmp_path):
    pq.write_table(pa.table({"text": ["short", "x" * 50, "ok"]}), tmp_path / "t.parquet")
    src = open_source(_spec(tmp_path / "t.parquet", max_tokens=16))
    with pytest.raises(SourceError) as err:
        src.metadata()
    assert str(err.value) == (
        "source 'src': 1 of 3 samples are longer than the 16-token limit (`data.sources.src.max_tokens`, which "
        "defaults to `data.seq_length`); the longest has 51 tokens (sample 1). Cut them to the limit with "
        "`data.sources.src.truncate=true`, make room with `data.seq_length=128 data.sources.src.max_tokens=128`, "
        "or skip them with `data.sources.src.max_bad_fraction=0.334`"
    )


def test_balancer_over_cap_error_names_seq_length_and_truncate():
    from megascale_data_ext.dataplane.balancers import partition
    from megascale_data_ext.errors import PlanError

    with pytest.raises(PlanError) as err:
        partition(np.ones(3), 2, tokens=np.array([10, 300, 10]), cap=256)
    msg = str(err.value)
    assert "item 1 has 300 tokens but the per-bin token cap is 256" in msg
    assert "`data.seq_length`" in msg and "set `truncate: true` on its source" in msg


def test_null_text_is_a_bad_sample(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "t.parquet")
    src = open_source(_spec(tmp_path / "t.parquet", max_bad_fraction=1.0))
    report = src.read_report([0, 1, 2])
    assert [s.index for s in report.skipped] == [1] and "null" in report.skipped[0].reason


def test_out_of_range_indices(tmp_path):
    src = open_source(_spec(_good(tmp_path)))
    with pytest.raises(IndexError, match=r"source 'src': indices \[8, -1\] out of range \[0, 8\)"):
        src.read([0, 8, -1])
    with pytest.raises(IndexError):
        src.metadata(np.array([9]))


def test_corrupt_row_group_data_is_source_error(tmp_path):
    path = _good(tmp_path, n=3000)
    data = bytearray(path.read_bytes())
    md = pq.ParquetFile(path).metadata
    col = md.row_group(500).column(0) if md.num_row_groups > 500 else md.row_group(1).column(0)
    start = col.data_page_offset
    data[start + 8 : start + 40] = b"\xff" * 32  # smash a data page, keep the footer intact
    path.write_bytes(bytes(data))
    src = open_source(_spec(path))
    with pytest.raises(SourceError, match=r"source .src.: .*good.parquet. cannot be read at row group \d+"):
        src.read(np.arange(len(src)))


def test_unknown_format_and_plugin(monkeypatch):
    with pytest.raises(ConfigError, match=r"must be one of \['jsonl', 'megatron', 'parquet', 'webdataset'\], got 'csv'"):
        SourceSpec(name="s", format="csv", paths=["x"])
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))  # keep the global registry clean
    monkeypatch.setattr(formats, "_PLUGGED", set())
    assert set(registry._FACTORIES) == set(formats.source_formats())  # a reader for every built-in name
    registry.register_source_format("fake", lambda spec, tokenizer=None: ("fake", spec.name))
    assert open_source(SourceSpec(name="s", format="fake", paths=["x"])) == ("fake", "s")
    assert "fake" in formats.source_formats()


def test_spec_problems_are_structured():
    values = {f.name: f.default for f in dataclasses.fields(SourceSpec)}
    values.update(name="s", format="csv", paths=["x"], weight=-1.0, row_group_cache=0)
    assert SourceSpec.field_problems(values) == [
        ("format", "must be one of ['jsonl', 'megatron', 'parquet', 'webdataset'], got 'csv'"),
        ("weight", "must be >= 0, got -1.0"),
        ("row_group_cache", "must be >= 1, got 0"),
    ]
    with pytest.raises(ConfigError, match=r"`data\.sources\.s\.weight` must be >= 0, got -1\.0"):
        SourceSpec(**values)


def test_resume_under_changed_config_says_what_to_do(tmp_path):
    from megascale_data_ext.errors import ResumeError
    from megascale_data_ext.runtime.loader import SourceLoader

    spec = _spec(_good(tmp_path))
    state = SourceLoader(0, spec, seed=3).state_dict()
    with pytest.raises(ResumeError) as err:
        SourceLoader(0, spec, seed=4).load_state_dict(state)
    msg = str(err.value)
    assert "`seed` changed: saved 3, now 4 (set `data.seed` back to 3 to continue the saved stream)" in msg
    assert msg.endswith("What to do: resume over the same files with the same seed and shuffle; to start a new data "
                        "stream instead, restore the model checkpoint without loading this data state")
