"""Sample-level transforms shared by every source format.

A format reader only extracts :class:`RawSample` rows (text or token ids, encoded image bytes,
and where they came from); :class:`SampleTransform` turns them into :class:`Sample` objects:
tokenize, append EOD, enforce ``max_tokens``, decode/patchify images or defer that to the Data
Constructor. The same object computes the metadata counts, so the cost the Planner balances on
is by construction the size ``read()`` produces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from megascale_data_ext.errors import SampleError
from megascale_data_ext.sources.base import DecodeImages, ReadResult, Sample, SkippedSample, SourceSpec
from megascale_data_ext.sources.images import decode_patches, header_patch_count
from megascale_data_ext.sources.tokenizer import Tokenizer, load_tokenizer
from megascale_data_ext.sources.tolerance import BadSampleTracker


@dataclass(slots=True, kw_only=True)
class RawSample:
    """One untransformed row as a format reader extracted it.

    Attributes:
        index: Sample index inside the source.
        text: Raw text (text sources); ``None`` when ``tokens`` is given.
        tokens: Pre-tokenized ids without the EOD the transform may append.
        images: Encoded image bytes, in sample order.
        path: File the row came from (for error messages).
        row: Row inside that file.
        error: Why the reader could not extract the row (e.g. invalid JSON); the transform
            turns it into a skipped sample.
        file_fault: ``error`` is the file's, not the row's: it was removed, truncated or
            corrupted since the source opened it (`sources.file_faults`).
    """

    index: int
    text: str | None = None
    tokens: np.ndarray | None = None
    images: list[bytes] = field(default_factory=list)
    path: str | None = None
    row: int | None = None
    error: str | None = None
    file_fault: bool = False


class SampleTransform:
    """Tokenization + image transform of one source, with an optional thread pool.

    Not thread-safe itself: one owner calls :meth:`run`, which fans samples out to
    ``spec.num_workers`` threads (Hugging Face tokenizers and Pillow release the GIL).
    """

    def __init__(self, spec: SourceSpec, tokenizer: Tokenizer | None = None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec)
        self.eod_id = int(spec.eod_token_id) if spec.eod_token_id is not None else self.tokenizer.eod_id
        self.tracker = BadSampleTracker(source=spec.name, max_bad_fraction=spec.max_bad_fraction)
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- metadata side
    def final_token_counts(self, body_counts: np.ndarray, *, add_eod: bool = True) -> np.ndarray:
        """Token counts incl. EOD that samples with ``body_counts`` ids will have after ``read()``.

        With ``truncate`` the count is capped at ``max_tokens``; without, over-long samples
        keep their true count (``read()`` will skip them as bad).
        """
        counts = np.asarray(body_counts, dtype=np.int64) + (1 if add_eod else 0)
        if self.spec.truncate and self.spec.max_tokens is not None:
            counts = np.minimum(counts, self.spec.max_tokens)
        return counts

    def text_token_counts(self, texts: Sequence[str | None]) -> np.ndarray:
        """Final token counts of raw texts (a null text counts as empty; ``read()`` skips it)."""
        return self.final_token_counts(self.tokenizer.count([t if t is not None else "" for t in texts]))

    def image_patch_counts(self, images: Sequence[bytes]) -> list[int]:
        """Patch counts from image headers; an unreadable header counts 0 (``read()`` skips it)."""
        out = []
        for data in images:
            try:
                out.append(
                    header_patch_count(data, patch_size=self.spec.patch_size, max_patches=self.spec.max_image_patches)
                )
            except SampleError:
                out.append(0)
        return out

    # ---------------------------------------------------------------- read side
    def _tokens(self, raw: RawSample) -> np.ndarray:
        spec = self.spec
        if raw.tokens is not None:
            body = np.asarray(raw.tokens, dtype=np.int64)
            add_eod = spec.append_eod
        elif raw.text is not None:
            body = self.tokenizer.encode(raw.text)
            add_eod = True
        else:
            raise SampleError("sample has neither text nor tokens (null value)")
        n = len(body) + (1 if add_eod else 0)
        if spec.max_tokens is not None and n > spec.max_tokens:
            if not spec.truncate:
                key, room = f"data.sources.{spec.name}", -(-n // 128) * 128  # room divides by 2 * pad * cp
                raise SampleError(f"sample has {n} tokens > max_tokens={spec.max_tokens}; cut it with "
                                  f"`{key}.truncate=true` or make room with "
                                  f"`data.seq_length={room} {key}.max_tokens={room}`")
            return np.append(body[: spec.max_tokens - 1], self.eod_id) if add_eod else body[: spec.max_tokens].copy()
        return np.append(body, self.eod_id) if add_eod else body.copy()

    def transform(self, raw: RawSample) -> Sample:
        """One raw row → one sample; raises :class:`SampleError` naming source, file and row."""
        try:
            if raw.error is not None:
                raise SampleError(raw.error)
            tokens = self._tokens(raw)
            sample = Sample(source=self.spec.name, index=raw.index, tokens=tokens, image_bytes=list(raw.images))
            if self.spec.decode_images == DecodeImages.LOADER:
                _decode_into(sample, patch_size=self.spec.patch_size, max_patches=self.spec.max_image_patches)
            elif not raw.images:
                sample.image_bytes = None
            return sample
        except SampleError as exc:
            raise SampleError(str(exc), source=self.spec.name, path=raw.path, row=raw.row) from exc

    def _try(self, raw: RawSample) -> Sample | SkippedSample:
        try:
            return self.transform(raw)
        except SampleError as exc:
            return SkippedSample(index=raw.index, reason=str(exc), path=raw.path, row=raw.row,
                                 file_fault=raw.file_fault)

    def map(self, fn: Callable[[RawSample], Sample | SkippedSample], raws: Sequence[RawSample]) -> list:
        """``fn`` over ``raws`` in order, on the worker pool when ``num_workers > 0``."""
        if self.spec.num_workers <= 0 or len(raws) < 2:
            return [fn(r) for r in raws]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.spec.num_workers, thread_name_prefix=f"src-{self.spec.name}")
        return list(self._pool.map(fn, raws))

    def run(self, raws: Sequence[RawSample], *, num_planned: int | None = None) -> ReadResult:
        """Transform ``raws``, skip-and-count the bad ones, enforce the tolerance.

        Args:
            raws: Rows in the order the caller asked for them.
            num_planned: Samples this read accounts for (defaults to ``len(raws)``); larger
                when the reader itself already skipped some rows.
        """
        results = self.map(self._try, raws)
        samples = [r for r in results if isinstance(r, Sample)]
        skipped = [r for r in results if isinstance(r, SkippedSample)]
        self.tracker.record(num_read=len(raws) if num_planned is None else num_planned, skipped=skipped)
        return ReadResult(samples=samples, skipped=skipped)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def decode_images(sample: Sample, *, patch_size: int = 16, max_patches: int = 1024) -> Sample:
    """Decode a sample's deferred ``image_bytes`` into patches, in place (Data Constructor side).

    Sets ``sample.images`` and ``sample.extra["image_grids"]`` and clears ``image_bytes``.
    Use the source's ``patch_size`` / ``max_image_patches`` so counts match its metadata.

    Raises:
        SampleError: An image cannot be decoded (names which one).
    """
    try:
        return _decode_into(sample, patch_size=patch_size, max_patches=max_patches)
    except SampleError as exc:
        raise SampleError(f"sample {sample.index}: {exc}", source=sample.source) from exc


class DeferredDecoder:
    """The Data Constructor's half of transformation reordering (paper Sec. 4).

    A source with ``decode_images="constructor"`` hands over its samples' encoded images;
    ``decoder(source_id, sample)`` decodes them with that source's ``patch_size`` and
    ``max_image_patches`` (source id = index in `specs`, as plans number sources), so a
    constructor packs exactly what loader-side decoding would have delivered. Stateless and
    thread-safe; the sample it is given is left as it is (a loader in the same process may keep
    it to serve a re-read).

    Args:
        specs: Every source of the service, in plan order.
    """

    def __init__(self, specs: Sequence[SourceSpec]) -> None:
        self.settings: dict[int, tuple[int, int]] = {
            i: (s.patch_size, s.max_image_patches) for i, s in enumerate(specs) if s.decode_images == DecodeImages.CONSTRUCTOR}

    @classmethod
    def of(cls, specs: Sequence[SourceSpec]) -> DeferredDecoder | None:
        """The decoder of `specs`, or None when every source decodes in its loader."""
        decoder = cls(specs)
        return decoder if decoder.settings else None

    def __call__(self, source_id: int, sample: Sample) -> Sample:
        """`sample` of source `source_id` with its deferred images decoded (a new `Sample`).

        Raises:
            SampleError: An image cannot be decoded (names the source, sample and image).
        """
        settings = self.settings.get(source_id)
        if settings is None or sample.image_bytes is None:
            return sample
        out = dataclasses.replace(sample, images=[], extra=dict(sample.extra))
        return decode_images(out, patch_size=settings[0], max_patches=settings[1])


def _decode_into(sample: Sample, *, patch_size: int, max_patches: int) -> Sample:
    images, grids = [], []
    for i, data in enumerate(sample.image_bytes or []):
        try:
            patches, grid = decode_patches(data, patch_size=patch_size, max_patches=max_patches)
        except SampleError as exc:
            raise SampleError(f"image {i}: {exc}") from exc
        images.append(patches)
        grids.append(grid)
    sample.images = images
    sample.extra["image_grids"] = grids
    sample.image_bytes = None
    return sample
