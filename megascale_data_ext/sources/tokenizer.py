"""Pluggable text tokenizers: byte-level by default, Hugging Face ``tokenizer.json`` files.

Token counts feed the Planner's cost model, so they must be identical whether computed at
``prepare`` time, in ``metadata()`` or in ``read()``: every path goes through
:meth:`Tokenizer.encode` / :meth:`Tokenizer.count` of the same tokenizer, and prepared files
record :meth:`Tokenizer.fingerprint` so a source can tell stale cost columns apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from megascale_data_ext.errors import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    """Text → ids without special tokens; the sample transform appends EOD itself."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def image_id(self) -> int | None: ...

    def encode(self, text: str) -> np.ndarray: ...

    def count(self, texts: Sequence[str]) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by :attr:`OFFSET`; ids below the offset are specials.

    Needs no file, so tests and demos are self-contained; ``vocab_size`` is 256 + specials.
    """

    PAD: int = 0
    EOD: int = 1
    IMAGE: int = 2
    OFFSET: int = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.OFFSET

    @property
    def eod_id(self) -> int:
        return self.EOD

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def image_id(self) -> int | None:
        return self.IMAGE

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + self.OFFSET

    def count(self, texts: Sequence[str]) -> np.ndarray:
        return np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[arr >= self.OFFSET] - self.OFFSET
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return f"byte-offset{self.OFFSET}"


_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "<|end_of_text|>", "[SEP]", "<eod>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
_IMAGE_CANDIDATES = ("<image>", "<|image|>", "<img>", "<|image_pad|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file loaded from disk (never from the hub).

    The EOD token is the first of the usual end-of-text spellings found in the vocabulary
    (or ``eod_token`` when given); PAD falls back to EOD, the image token to ``None``.
    """

    def __init__(self, path: str | Path, *, eod_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        self._path = Path(path)
        if not self._path.is_file():
            raise ConfigError(f"tokenizer file {str(self._path)!r} not found: give a path to a tokenizer.json")
        try:
            self._tok = _HF.from_file(str(self._path))
        except Exception as exc:  # the Rust side raises plain Exception for bad JSON
            raise ConfigError(f"cannot load tokenizer {str(self._path)!r}: {exc}") from exc
        self._eod = self._find((eod_token,) if eod_token else _EOD_CANDIDATES)
        if self._eod is None:
            raise ConfigError(
                f"tokenizer {str(self._path)!r} has none of the EOD tokens {list(_EOD_CANDIDATES)}; "
                "add one to its vocabulary or pass eod_token"
            )
        pad = self._find(_PAD_CANDIDATES)
        self._pad = self._eod if pad is None else pad
        self._image = self._find(_IMAGE_CANDIDATES)
        self._fingerprint = "hf-" + hashlib.sha256(self._path.read_bytes()).hexdigest()[:16]

    def _find(self, candidates: Sequence[str]) -> int | None:
        for tok in candidates:
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                return int(tid)
        return None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod_id(self) -> int:
        return self._eod  # type: ignore[return-value]

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def image_id(self) -> int | None:
        return self._image

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def count(self, texts: Sequence[str]) -> np.ndarray:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return self._fingerprint


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The byte-level tokenizer for ``None``, else the Hugging Face JSON file at ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
