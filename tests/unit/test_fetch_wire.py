"""A loader's fetch reply as columns (`runtime.fetch_wire`): what arrives is what was sent."""

import pickle

import numpy as np

from megascale_data_ext.runtime.fetch_wire import TextColumns, decode_fetch, encode_fetch
from megascale_data_ext.sources.base import Sample, SkippedSample


def _text(index: int, n: int, dtype=np.int64) -> Sample:
    return Sample(source="web", index=index, tokens=np.arange(index, index + n, dtype=dtype))


def _same(a: dict, b: dict) -> None:
    assert len(a["samples"]) == len(b["samples"])
    for (b1, p1, s1), (b2, p2, s2) in zip(a["samples"], b["samples"], strict=True):
        assert (b1, p1) == (b2, p2)
        assert (s1.source, s1.index, s1.image_bytes, s1.extra) == (s2.source, s2.index, s2.image_bytes, s2.extra)
        assert s1.tokens.dtype == s2.tokens.dtype and np.array_equal(s1.tokens, s2.tokens)
        assert len(s1.images) == len(s2.images) and all(np.array_equal(x, y) for x, y in zip(s1.images, s2.images))
    assert [(b, p, s.index, s.reason) for b, p, s in a["skipped"]] == \
        [(b, p, s.index, s.reason) for b, p, s in b["skipped"]]


def test_text_samples_travel_as_columns_and_arrive_in_order():
    rng = np.random.default_rng(0)
    got = {"samples": [(int(b), 100 + k, _text(k, int(n))) for k, (b, n) in
                       enumerate(zip(rng.integers(0, 4, 50), rng.integers(0, 300, 50)))],
           "skipped": [(1, 7, SkippedSample(index=7, reason="bad row"))]}
    wire = encode_fetch(got)
    assert isinstance(wire["text"], TextColumns) and wire["rest"] == []
    _same(decode_fetch(pickle.loads(pickle.dumps(wire))), got)


def test_samples_with_images_extra_fields_or_other_dtypes_travel_as_they_are():
    image = Sample(source="web", index=1, tokens=np.arange(5), images=[np.ones((4, 12), np.float32)])
    extra = Sample(source="web", index=2, tokens=np.arange(3), extra={"image_grids": [(2, 2)]})
    narrow = _text(3, 4, dtype=np.int32)
    got = {"samples": [(0, 0, _text(0, 6)), (0, 1, image), (1, 2, extra), (1, 3, narrow), (2, 4, _text(4, 2)),
                       (2, 5, {"tokens": np.arange(2)})],
           "skipped": []}
    wire = encode_fetch(got)
    assert wire["text"].order.tolist() == [0, 4]
    assert [at for at, _ in wire["rest"]] == [1, 2, 3, 5]
    back = decode_fetch(pickle.loads(pickle.dumps(wire)))
    assert back["samples"][5][:2] == (2, 5) and np.array_equal(back["samples"][5][2]["tokens"], np.arange(2))
    got_mapped, back_mapped = dict(got), dict(back)
    got_mapped["samples"], back_mapped["samples"] = got["samples"][:5], back["samples"][:5]
    _same(back_mapped, got_mapped)


def test_an_empty_or_image_only_fetch_is_left_as_it_is():
    assert encode_fetch({"samples": [], "skipped": []}) == {"samples": [], "skipped": []}
    image = Sample(source="web", index=1, tokens=np.arange(5), images=[np.ones((4, 12), np.float32)])
    got = {"samples": [(0, 0, image)], "skipped": []}
    assert encode_fetch(got)["samples"] is got["samples"]
    assert decode_fetch(encode_fetch(got))["samples"] is got["samples"]


def test_columns_pickle_smaller_than_the_samples():
    got = {"samples": [(k % 4, k, _text(k, 400)) for k in range(64)], "skipped": []}
    assert len(pickle.dumps(encode_fetch(got), protocol=5)) < len(pickle.dumps(got, protocol=5))
