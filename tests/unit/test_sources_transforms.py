"""Tokenizers, NaViT patch grid/patchify, metadata helpers, tolerance tracker."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from megascale_data_ext.errors import ConfigError, SampleError, SourceError
from megascale_data_ext.sources import ByteTokenizer, DeferredDecoder, Sample, SourceSpec, make_metadata, take_metadata
from megascale_data_ext.sources.base import SkippedSample
from megascale_data_ext.sources.images import (
    IMAGE_MEAN,
    IMAGE_STD,
    decode_patches,
    header_patch_count,
    image_patch_count,
    image_patch_grid,
    patchify,
    synthetic_jpeg,
)
from megascale_data_ext.sources.tokenizer import HFTokenizer
from megascale_data_ext.sources.tolerance import BadSampleTracker


@given(st.text(max_size=50))
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and (ids >= tok.OFFSET).all() and (ids < tok.vocab_size).all()
    assert tok.decode(ids) == text
    assert tok.count([text, text + "a"]).tolist() == [len(ids), len(ids) + 1]
    assert len({tok.pad_id, tok.eod_id, tok.image_id}) == 3 and max(tok.pad_id, tok.eod_id, tok.image_id) < tok.OFFSET


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([14, 16, 32]), st.integers(1, 2048))
def test_patch_grid_respects_cap_and_rounding(w, h, p, cap):
    rows, cols = image_patch_grid(w, h, patch_size=p, max_patches=cap)
    assert rows >= 1 and cols >= 1 and rows * cols <= cap
    nat_r, nat_c = max(1, round(h / p + 1e-9)), max(1, round(w / p + 1e-9))
    if nat_r * nat_c <= cap:  # no downscale needed: nearest multiple of the patch size
        assert abs(rows * p - h) <= p / 2 + 1e-9 or rows == 1
        assert abs(cols * p - w) <= p / 2 + 1e-9 or cols == 1
    else:
        assert rows <= nat_r and cols <= nat_c
    assert image_patch_count(w, h, patch_size=p, max_patches=cap) == rows * cols


@pytest.mark.parametrize(
    "size,cap", [((37, 250), 64), ((640, 480), 1024), ((1000, 30), 16), ((8, 8), 4), ((333, 333), 100)]
)
def test_header_count_equals_decoded_patches(size, cap):
    data = synthetic_jpeg(*size, seed=3)
    patches, (rows, cols) = decode_patches(data, patch_size=16, max_patches=cap)
    assert patches.shape == (rows * cols, 16 * 16 * 3) and patches.dtype == np.float32
    assert header_patch_count(data, patch_size=16, max_patches=cap) == rows * cols


def test_decode_normalizes_and_orders_patches_row_major():
    # Lossless PNG, 2x3 patches of 4 px, each patch a distinct solid colour.
    colours = np.arange(6 * 3, dtype=np.uint8).reshape(2, 3, 3) * 13
    pixels = np.repeat(np.repeat(colours, 4, axis=0), 4, axis=1)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    patches, grid = decode_patches(buf.getvalue(), patch_size=4, max_patches=100)
    assert grid == (2, 3)
    expected = (colours.reshape(6, 3).astype(np.float32) / 255.0 - IMAGE_MEAN) / IMAGE_STD
    np.testing.assert_allclose(patches.reshape(6, 16, 3), np.broadcast_to(expected[:, None, :], (6, 16, 3)), atol=1e-5)


def test_patchify_is_invertible():
    x = np.random.default_rng(0).random((3 * 5, 2 * 5, 3)).astype(np.float32)
    p = patchify(x, 5)
    back = p.reshape(3, 2, 5, 5, 3).transpose(0, 2, 1, 3, 4).reshape(15, 10, 3)
    np.testing.assert_array_equal(back, x)


def test_undecodable_image_raises_sample_error():
    with pytest.raises(SampleError, match="cannot decode image"):
        decode_patches(b"not an image at all")
    with pytest.raises(SampleError, match="cannot read image header"):
        header_patch_count(b"\xff\xd8garbage")


def test_take_metadata_ragged_gather():
    meta = make_metadata(np.array([5, 6, 7, 8]), [[1], [], [2, 3, 4], [9, 10]])
    assert meta["image_offsets"].tolist() == [0, 1, 1, 4, 6]
    sub = take_metadata(meta, np.array([3, 0, 2, 1, 3]))
    assert sub["text_tokens"].tolist() == [8, 5, 7, 6, 8]
    assert sub["num_images"].tolist() == [2, 1, 3, 0, 2]
    assert sub["image_offsets"].tolist() == [0, 2, 3, 6, 6, 8]
    assert sub["image_patch_counts"].tolist() == [9, 10, 1, 2, 3, 4, 9, 10]
    assert all(v.dtype == np.int64 for v in sub.values())


def test_tracker_budget():
    tr = BadSampleTracker(source="s", max_bad_fraction=0.2)
    bad = SkippedSample(index=3, reason="boom (source=s, file=f, row=3)", path="f", row=3)
    tr.record(num_read=10, skipped=[bad])  # 1 <= 2
    tr.record(num_read=5, skipped=[bad, bad])  # 3 <= 3
    with pytest.raises(SourceError, match=r"source 's': 4 bad samples out of 16 read exceeds max_bad_fraction=0.2"):
        tr.record(num_read=1, skipped=[bad])
    assert tr.reasons() == {"boom": 4}


def test_spec_validation_lists_every_problem():
    with pytest.raises(ConfigError) as err:
        SourceSpec(name="s", format="csv", paths=[], patch_size=0, decode_images="gpu", max_bad_fraction=2.0)
    msg = str(err.value)
    for frag in ("sources.s.format", "'parquet'", "sources.s.paths", "patch_size", "decode_images", "max_bad_fraction"):
        assert frag in msg
    with pytest.raises(ConfigError, match=r"unknown keys \['colour'\]"):
        SourceSpec.from_mapping({"name": "s", "format": "parquet", "paths": ["x"], "colour": 1})
    assert SourceSpec.from_mapping({"name": "s", "format": "parquet", "paths": "x"}).paths == ["x"]


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        HFTokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match=r"`tokenizer`: cannot load .*bad.json. as a Hugging Face tokenizer.json"):
        HFTokenizer(tmp_path / "bad.json")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "noeod.json"))
    with pytest.raises(ConfigError, match="none of the EOD tokens"):
        HFTokenizer(tmp_path / "noeod.json")


def test_deferred_decoder_decodes_each_source_with_its_own_settings_and_leaves_the_input():
    specs = [SourceSpec(name="text", format="parquet", paths=["t"]),
             SourceSpec(name="a", format="parquet", paths=["a"], image_column="im", decode_images="constructor",
                        patch_size=16, max_image_patches=64),
             SourceSpec(name="b", format="parquet", paths=["b"], image_column="im", decode_images="constructor",
                        patch_size=8, max_image_patches=32)]
    decoder = DeferredDecoder.of(specs)
    assert DeferredDecoder.of(specs[:1]) is None  # nothing deferred: no decoding step at all
    jpeg = synthetic_jpeg(96, 64, seed=1)
    for source, (patch, cap) in ((1, (16, 64)), (2, (8, 32))):
        raw = Sample(source=specs[source].name, index=3, tokens=np.arange(4), image_bytes=[jpeg])
        out = decoder(source, raw)
        want, grid = decode_patches(jpeg, patch_size=patch, max_patches=cap)
        assert len(out.images) == 1 and np.array_equal(out.images[0], want)
        assert out.extra["image_grids"] == [grid] and out.image_bytes is None
        assert raw.image_bytes == [jpeg] and raw.images == [] and raw.extra == {}  # a loader may serve it again
    text = Sample(source="text", index=0, tokens=np.arange(3))
    assert decoder(0, text) is text
    with pytest.raises(SampleError, match=r"sample 7: image 0"):
        decoder(1, Sample(source="a", index=7, tokens=np.arange(2), image_bytes=[b"not an image"]))
