"""A loader's fetch reply as a few arrays: what crosses from a loader actor to a constructor.

`SourceLoader.fetch` answers ``{"samples": [(bucket, position, Sample)], "skipped": [...]}``.
Sent as it is, Ray pickles every `Sample` and hands each sample's token array to its
serializer as a buffer of its own: per sample, on both sides of every call, a good part of a
loader's and a constructor's CPU per step. Text samples (tokens only: no images, no encoded
images, no extra fields) travel instead as columns — buckets, positions, indices, lengths and
one concatenated token array per dtype — and are rebuilt on arrival as samples whose tokens
are views of that array. Anything else (images, extra fields, skipped rows) travels as it was.
Plain code, no Ray: `LoaderGroupActor.fetch_many` encodes, `RoutedFetch` decodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from megascale_data_ext.sources.base import Sample

__all__ = ["TextColumns", "decode_fetch", "encode_fetch"]


@dataclass(frozen=True, slots=True)
class TextColumns:
    """Text samples of one source's fetch: row i is ``(bucket[i], position[i], Sample(source,
    index[i], tokens[offsets[i]:offsets[i + 1]]))`` and sits at place ``order[i]`` of the reply."""

    source: str
    order: np.ndarray
    bucket: np.ndarray
    position: np.ndarray
    index: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray


def _plain_text(sample: Any, name: str, dtype: np.dtype) -> bool:
    return (type(sample) is Sample and sample.source == name and not sample.images and sample.image_bytes is None
            and not sample.extra and type(sample.tokens) is np.ndarray and sample.tokens.ndim == 1
            and sample.tokens.dtype == dtype)


def encode_fetch(got: Mapping[str, list]) -> dict[str, Any]:
    """`got` (a `SourceLoader.fetch` reply) with its text samples as `TextColumns`."""
    samples = got["samples"]
    if not samples:
        return dict(got)
    first = samples[0][2]
    name = getattr(first, "source", None)
    dtype = getattr(getattr(first, "tokens", None), "dtype", None)
    if name is None or dtype is None:
        return dict(got)
    text = [i for i, (_b, _p, s) in enumerate(samples) if _plain_text(s, name, dtype)]
    if not text:
        return dict(got)
    rows = [samples[i] for i in text]
    lengths = np.fromiter((len(s.tokens) for _b, _p, s in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    columns = TextColumns(
        source=name, order=np.asarray(text, dtype=np.int64),
        bucket=np.fromiter((b for b, _p, _s in rows), dtype=np.int64, count=len(rows)),
        position=np.fromiter((p for _b, p, _s in rows), dtype=np.int64, count=len(rows)),
        index=np.fromiter((s.index for _b, _p, s in rows), dtype=np.int64, count=len(rows)),
        offsets=offsets, tokens=np.concatenate([s.tokens for _b, _p, s in rows]))
    keep = set(text)
    rest = [(i, x) for i, x in enumerate(samples) if i not in keep]
    return {"text": columns, "rest": rest, "skipped": got["skipped"]}


def decode_fetch(wire: Mapping[str, Any]) -> dict[str, list]:
    """The `SourceLoader.fetch` reply `encode_fetch` was given, samples in their order (tokens are
    read-only views of one array: packing copies them, nothing writes them)."""
    columns: TextColumns | None = wire.get("text")
    if columns is None:
        return dict(wire)
    n = len(columns.order) + len(wire["rest"])
    samples: list[Any] = [None] * n
    off, tokens, name = columns.offsets.tolist(), columns.tokens, columns.source
    for k, (at, b, p, i) in enumerate(zip(columns.order.tolist(), columns.bucket.tolist(), columns.position.tolist(),
                                          columns.index.tolist(), strict=True)):
        samples[at] = (b, p, Sample(source=name, index=i, tokens=tokens[off[k]:off[k + 1]]))
    for at, x in wire["rest"]:
        samples[at] = x
    return {"samples": samples, "skipped": wire["skipped"]}
