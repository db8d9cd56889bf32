"""WebDataset / Megatron-Energon shards as a source: ``.tar`` files of samples keyed by name.

The format multimodal Megatron users already hold: a shard is a tar whose members are grouped
into samples by key (``<key>.<ext>``: the basename up to its first dot), e.g. ``0001.txt`` +
``0001.jpg``. Energon's own ``.nv-meta`` index describes the same tars; this reader builds its
index from the tar headers when the source opens (headers only, no payload), then reads every
planned member with one seek, so any sample can be read at any time — what makes it exactly-once
and resumable like the other formats (the Planner's plans are positions -> sample indices).

Text comes from the member whose extension is ``text_column`` (``txt`` / ``text`` / ``caption``
when that is ``"text"``), or from that field of a ``.json`` member; with ``image_column`` set,
the sample's image members (``jpg``, ``jpeg``, ``png``, ``webp``; or exactly ``image_column``
when it names an extension) are its images, in name order. A sample without text is bad (the
source's ``on_bad_rows`` policy decides), found when opening.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass, field

import numpy as np

from megascale_data_ext.errors import SampleError, SourceError
from megascale_data_ext.sources.base import BadRows, SourceSpec, make_metadata
from megascale_data_ext.sources.rowsource import RowSource, empty_source_error, resolve_files
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.transforms import RawSample

__all__ = ["WebDatasetSource", "sample_key"]

TEXT_EXTENSIONS = ("txt", "text", "caption")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def sample_key(member: str) -> tuple[str, str]:
    """``(key, extension)`` of a tar member name, WebDataset's way: the extension starts at the
    first dot of the basename (``a/b/0001.seg.jpg`` -> ``("a/b/0001", "seg.jpg")``)."""
    head, _, base = member.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


@dataclass(slots=True)
class _Sample:
    key: str
    members: dict[str, tuple[int, int]] = field(default_factory=dict)  # extension -> (data offset, size)


class WebDatasetSource(RowSource):
    """The samples of one or more ``.tar`` shards, in shard then first-member order."""

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(spec, tokenizer=tokenizer)
        self.paths = resolve_files(spec.name, spec.paths, suffixes=(".tar",))
        self._text_exts = TEXT_EXTENSIONS if spec.text_column == "text" else (spec.text_column,)
        if spec.image_column is None:
            self._image_exts: tuple[str, ...] = ()
        else:
            self._image_exts = (spec.image_column,) if spec.image_column not in ("image", "images") \
                else IMAGE_EXTENSIONS
        self._samples: list[list[_Sample]] = [self._index(p) for p in self.paths]
        bad = [(p, s.key) for p, ss in zip(self.paths, self._samples, strict=True) for s in ss if self._text(s) is None]
        total = sum(len(ss) for ss in self._samples)
        key = f"data.sources.{spec.name}"
        if bad and spec.on_bad_rows == BadRows.SKIP:
            self._samples = [[s for s in ss if self._text(s) is not None] for ss in self._samples]
        elif bad and len(bad) > spec.max_bad_fraction * total:
            raise SourceError(f"source {self.name!r}: {len(bad)} of {total} samples have no text member "
                              f"({', '.join(self._text_exts)} or a .json with {spec.text_column!r}), e.g. "
                              f"{bad[0][1]!r} in {bad[0][0]}; leave them out with `{key}.on_bad_rows=skip` or set "
                              f"`{key}.text_column` to the extension holding the text")
        self._start = np.concatenate([[0], np.cumsum([len(ss) for ss in self._samples], dtype=np.int64)])
        self._sizes = [os.path.getsize(p) for p in self.paths]
        if len(self) == 0:
            raise empty_source_error(self.name, f"no samples in the shards {self.paths[:3]}")

    @staticmethod
    def _index(path: str) -> list[_Sample]:
        """Samples of one shard from its tar headers (payloads are not read)."""
        try:
            with tarfile.open(path, "r:") as tar:
                members = [m for m in tar.getmembers() if m.isfile()]
        except (tarfile.TarError, OSError) as exc:
            raise SourceError(f"shard {path!r} is not a readable (uncompressed) tar: {exc}") from exc
        by_key: dict[str, _Sample] = {}
        for m in members:
            key, ext = sample_key(m.name)
            if ext:
                by_key.setdefault(key, _Sample(key)).members[ext] = (m.offset_data, m.size)
        return list(by_key.values())

    def _text(self, s: _Sample) -> str | None:
        """The extension holding the text ("json" when it is a field of the .json member), else None."""
        for ext in self._text_exts:
            if ext in s.members:
                return ext
        return "json" if "json" in s.members else None

    def __len__(self) -> int:
        return int(self._start[-1])

    def _locate(self, index: int) -> tuple[int, _Sample]:
        f_i = int(np.searchsorted(self._start, index, side="right") - 1)
        return f_i, self._samples[f_i][index - int(self._start[f_i])]

    def where(self, index: int) -> str:
        f_i, s = self._locate(index)
        return f"{self.paths[f_i]} sample {s.key!r}"

    def _payload(self, fh, f_i: int, member: tuple[int, int]) -> bytes:
        offset, size = member
        if offset + size > self._sizes[f_i]:
            raise _FileFault(f"was truncated to {self._sizes[f_i]} bytes")
        fh.seek(offset)
        data = fh.read(size)
        if len(data) != size:
            raise _FileFault(f"was truncated to {fh.tell()} bytes")
        return data

    def _row(self, fh, f_i: int, s: _Sample) -> tuple[str, list[bytes]]:
        ext = self._text(s)
        if ext is None:
            raise SampleError(f"sample {s.key!r} has no text member")
        raw = self._payload(fh, f_i, s.members[ext])
        if ext == "json":
            try:
                text = json.loads(raw).get(self.spec.text_column)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
                raise SampleError(f"sample {s.key!r}: its .json is not an object: {exc}") from exc
            if not isinstance(text, str):
                raise SampleError(f"sample {s.key!r}: its .json has no string {self.spec.text_column!r}")
        else:
            text = raw.decode("utf-8", errors="replace")
        images = [self._payload(fh, f_i, s.members[e]) for e in sorted(s.members)
                  if e in self._image_exts or e.rpartition(".")[2] in self._image_exts]
        return text, images

    def _compute_metadata(self) -> dict[str, np.ndarray]:
        tf = self._transform
        texts: list[str | None] = []
        patches: list[list[int]] = []
        for f_i, path in enumerate(self.paths):
            with open(path, "rb") as fh:
                for s in self._samples[f_i]:
                    try:
                        text, images = self._row(fh, f_i, s)
                    except SampleError:
                        texts.append(None)  # read() skips it
                        patches.append([])
                        continue
                    texts.append(text)
                    patches.append(tf.image_patch_counts(images))
        return make_metadata(tf.text_token_counts(texts), patches)

    def _raw_rows(self, indices: np.ndarray) -> list[RawSample]:
        out, handles, gone = [], {}, {}
        try:
            for index in indices.tolist():
                f_i, s = self._locate(index)
                raw = RawSample(index=index, path=self.paths[f_i], row=index - int(self._start[f_i]))
                try:
                    if f_i not in handles and f_i not in gone:
                        try:
                            handles[f_i] = open(self.paths[f_i], "rb")
                            self._sizes[f_i] = min(self._sizes[f_i], os.fstat(handles[f_i].fileno()).st_size)
                        except OSError as exc:  # opened fine at start: removed since
                            gone[f_i] = f"cannot be opened any more ({exc.strerror or exc})"
                    if f_i in gone:
                        raise _FileFault(gone[f_i])
                    raw.text, raw.images = self._row(handles[f_i], f_i, s)
                except _FileFault as exc:
                    raw.error, raw.file_fault = str(exc), True
                except (SampleError, OSError) as exc:
                    raw.error = f"cannot load sample: {exc}"
                out.append(raw)
        finally:
            for fh in handles.values():
                fh.close()
        return out


class _FileFault(SampleError):
    """A shard that lost data since the source opened it (removed, truncated): the file's fault."""
