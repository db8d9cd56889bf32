"""`megascale-data prepare` end to end: raw inputs → Parquet a ParquetSource plans from."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from megascale_data_ext.cli import main
from megascale_data_ext.sources import ByteTokenizer, SourceSpec, open_source
from megascale_data_ext.sources.images import header_patch_count, synthetic_jpeg
from megascale_data_ext.sources.parquet import KV_PATCH_SIZE, KV_TOKENIZER


def _read_all(out_dir):
    files = sorted(out_dir.glob("*.parquet"))
    return files, pq.ParquetDataset([str(f) for f in files]).read().to_pylist()


def test_prepare_text_files_row_groups_and_files(tmp_path, capsys):
    docs = [f"document {i} " + "word " * (i * 7) for i in range(23)]
    inputs = []
    for i, d in enumerate(docs[:20]):
        (tmp_path / f"doc{i:02d}.txt").write_text(d)
        inputs.append(str(tmp_path / f"doc{i:02d}.txt"))
    (tmp_path / "lines.txt").write_text("\n".join(docs[20:]) + "\n\n")
    out = tmp_path / "out"
    rc = main(
        [
            "prepare",
            "--input",
            *inputs,
            "--output",
            str(out),
            "--row-group-rows",
            "4",
            "--rows-per-file",
            "10",
            "--no-progress",
        ]
    )
    assert rc == 0
    files, rows = _read_all(out)
    assert len(files) == 2 and [pq.ParquetFile(f).metadata.num_row_groups for f in files] == [3, 3]
    assert [r["text"] for r in rows] == docs[:20]
    assert [r["num_tokens"] for r in rows] == [len(d.encode()) + 1 for d in docs[:20]]
    assert (
        pq.ParquetFile(files[0]).schema_arrow.metadata[KV_TOKENIZER.encode()] == ByteTokenizer().fingerprint().encode()
    )
    summary = capsys.readouterr().out
    assert (
        "wrote 20 rows to 2 file(s)" in summary
        and f"text tokens (incl. EOD): {sum(len(d) + 1 for d in docs[:20])}" in summary
    )

    out2 = tmp_path / "out2"
    assert (
        main(
            ["prepare", "--input", str(tmp_path / "lines.txt"), "--output", str(out2), "--split-lines", "--no-progress"]
        )
        == 0
    )
    assert [r["text"] for r in _read_all(out2)[1]] == docs[20:]


def test_prepare_jsonl_image_text_then_source_plans_from_costs(tmp_path, capsys):
    (tmp_path / "im").mkdir()
    sizes = [(50, 300), (640, 480), (17, 17), (200, 90)]
    for i, (w, h) in enumerate(sizes):
        (tmp_path / "im" / f"{i}.jpg").write_bytes(synthetic_jpeg(w, h, seed=i))
    (tmp_path / "im" / "bad.jpg").write_bytes(b"definitely not a jpeg")
    recs = [
        {"text": "a cat", "image": "im/0.jpg"},
        {"text": "two", "image": ["im/1.jpg", "im/2.jpg"]},
        {"text": "no image"},
        {"text": "broken", "image": "im/bad.jpg"},
        {"text": "a dog " * 30, "image": "im/3.jpg"},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    out = tmp_path / "out"
    rc = main(
        [
            "prepare",
            "--input",
            str(tmp_path / "d.jsonl"),
            "--output",
            str(out),
            "--kind",
            "image-text",
            "--patch-size",
            "14",
            "--no-progress",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "wrote 4 rows" in captured.out and "skipped rows: 2" in captured.out
    assert "d.jsonl:4: cannot read image header" in captured.out and "d.jsonl:6: invalid JSON" in captured.out
    files, rows = _read_all(out)
    assert [r["text"] for r in rows] == ["a cat", "two", "no image", "a dog " * 30]
    hdr = [header_patch_count((tmp_path / "im" / f"{i}.jpg").read_bytes(), patch_size=14) for i in range(4)]
    assert [r["image_patches"] for r in rows] == [[hdr[0]], [hdr[1], hdr[2]], [], [hdr[3]]]
    assert pq.ParquetFile(files[0]).schema_arrow.metadata[KV_PATCH_SIZE.encode()] == b"14"

    spec = SourceSpec(name="p", format="parquet", paths=[str(out)], image_column="image", patch_size=14)
    src = open_source(spec)
    meta = src.metadata()
    assert set(src.columns_read("metadata")) == {"num_tokens", "image_patches"}
    samples = src.read(np.arange(4))
    assert [len(s.tokens) for s in samples] == meta["text_tokens"].tolist()
    assert [im.shape[0] for s in samples for im in s.images] == meta["image_patch_counts"].tolist() == hdr

    # Other patch size than prepared: the stale image_patches column is not trusted.
    src16 = open_source(SourceSpec(name="p", format="parquet", paths=[str(out)], image_column="image"))
    assert src16.metadata()["image_patch_counts"].tolist() == [
        header_patch_count((tmp_path / "im" / f"{i}.jpg").read_bytes(), patch_size=16) for i in range(4)
    ]
    assert "image" in src16.columns_read("metadata")


def test_prepare_captioned_image_folder(tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(3):
        (folder / f"p{i}.jpg").write_bytes(synthetic_jpeg(40 * (i + 1), 60, seed=i))
    (folder / "p0.txt").write_text("first caption\n")
    (folder / "p2.txt").write_text("third")
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(folder), "--output", str(out), "--kind", "image-text"]) == 0
    captured = capsys.readouterr()
    assert "prepare" in captured.err  # tqdm progress bar on stderr
    rows = _read_all(out)[1]
    assert [r["text"] for r in rows] == ["first caption", "", "third"]
    assert [len(r["image"]) for r in rows] == [1, 1, 1]
    assert rows[1]["image"][0] == (folder / "p1.jpg").read_bytes()


def test_prepare_errors(tmp_path, capsys):
    assert (
        main(["prepare", "--input", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o"), "--no-progress"])
        == 2
    )
    assert "input '" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("a,b")
    assert main(["prepare", "--input", str(tmp_path / "x.csv"), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "neither .txt, .jsonl nor a directory" in capsys.readouterr().err
    assert (
        main(["prepare", "--input", str(tmp_path / "x.csv"), "--output", str(tmp_path / "o"), "--row-group-rows", "0"])
        == 2
    )
    assert "`row_group_rows`" in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("hello\n")
    assert main(["prepare", "--input", str(tmp_path / "t.txt"), "--output", str(tmp_path / "x.csv"), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write Parquet shards to {str(tmp_path / 'x.csv')!r}")


def test_prepare_progress_counts_input_bytes_against_their_total(tmp_path, capsys):
    import re

    from megascale_data_ext.sources.prepare import prepare

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(6)) + "\n")
    (tmp_path / "b.txt").write_text("one\n\ntwo\n")
    total = sum((tmp_path / n).stat().st_size for n in ("a.jsonl", "b.txt"))
    assert total < 1000  # printed without a k/M suffix
    prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")], str(tmp_path / "out"), split_lines=True)
    err = capsys.readouterr().err
    final = re.findall(r"prepare: 100%\|[^|]*\| (\d+)/(\d+) \[(\S+)<(\S+),", err)  # done/total [elapsed<ETA,
    assert final and final[-1][:2] == (str(total), str(total))


def test_prepare_with_no_usable_row_names_the_first_skipped(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\nnot json\n')
    assert main(["prepare", "--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no rows written" in err and "(2 rows skipped, first: " in err
    assert f'{tmp_path / "bad.jsonl"}:1: expected an object with a string "text" field' in err
    assert f"{tmp_path / 'bad.jsonl'}:2: invalid JSON" in err and "give inputs with usable text" in err


def test_prepare_json_keys_and_the_manifest(tmp_path, capsys):
    """--json-keys picks (and joins) the text fields, as Megatron's preprocess_data does; manifest.json
    records the shards, totals, settings and the source entry, which then reads the directory."""
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"title": f"t{i}", "body": "x" * (10 + i), "text": "ignored"})
                             for i in range(7)) + "\n" + json.dumps({"title": "no body"}) + "\n")
    out = tmp_path / "prepared"
    assert main(["prepare", "--input", str(src), "--output", str(out), "--json-keys", "title", "body",
                 "--no-progress"]) == 0
    assert f"manifest: {out / 'manifest.json'}" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["rows"] == 7 and manifest["skipped_rows"] == 1
    assert manifest["settings"]["json_keys"] == ["title", "body"] and manifest["inputs"] == [str(src)]
    assert [f["name"] for f in manifest["files"]] == [p.name for p in sorted(out.glob("*.parquet"))]
    _, rows = _read_all(out)
    assert rows[0]["text"] == "t0\n\n" + "x" * 10 and rows[6]["num_tokens"] == len("t6\n\n") + 16 + 1  # + EOD
    assert len(open_source(SourceSpec(**manifest["source"]))) == 7  # the entry reads what was written
