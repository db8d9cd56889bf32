"""Text tokenizers as Megatron users name them, plus a file-free byte tokenizer for demos.

``tokenizer_type`` takes Megatron's ``--tokenizer-type`` spellings: ``HuggingFaceTokenizer``
(a ``tokenizer.json``, or a directory holding one; never the hub), ``SentencePieceTokenizer``
(a ``.model`` file), ``GPT2BPETokenizer`` (Megatron's ``vocab.json`` + ``merges.txt``) and
``ByteTokenizer`` (no file). Left out, the type follows from the path.

Token counts feed the Planner's cost model, so they must be identical whether computed at
``prepare`` time, in ``metadata()`` or in ``read()``: every path goes through
:meth:`Tokenizer.encode` / :meth:`Tokenizer.count` of the same tokenizer, and prepared files
record :meth:`Tokenizer.fingerprint` so a source can tell stale cost columns apart.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import numpy as np

from megascale_data_ext.errors import ConfigError

#: Megatron's ``--tokenizer-type`` names this package reads, plus the demo's byte tokenizer.
TokenizerType = Literal["ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"]


def tokenizer_types() -> list[str]:
    """The valid ``tokenizer_type`` values, sorted (for error messages)."""
    return sorted(get_args(TokenizerType))


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


class _SpecialIds:
    """The special token ids every tokenizer answers, from the ``_eod``, ``_pad`` and ``_image`` it sets."""

    _eod: int
    _pad: int
    _image: int | None

    @property
    def eod_id(self) -> int:
        return self._eod

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def image_id(self) -> int | None:
        return self._image


class ByteTokenizer(_SpecialIds):
    """UTF-8 bytes shifted by :attr:`OFFSET`; ids below the offset are specials.

    Needs no file, so tests and demos are self-contained; ``vocab_size`` is 256 + specials.
    """

    PAD: int = 0
    EOD: int = 1
    IMAGE: int = 2
    OFFSET: int = 3
    _pad, _eod, _image = PAD, EOD, IMAGE

    @property
    def vocab_size(self) -> int:
        return 256 + self.OFFSET

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


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


class _RustTokenizer(_SpecialIds):
    """Shared body of the tokenizers backed by a Hugging Face ``tokenizers.Tokenizer`` object.

    The EOD token is the first of the usual end-of-text spellings found in the vocabulary
    (or ``eod_token`` when given); PAD falls back to EOD, the image token to ``None``.
    """

    def __init__(self, tok: Any, *, where: str, fingerprint: str, eod_token: str | None, key: str) -> None:
        self._tok = tok
        candidates = (eod_token,) if eod_token else _EOD_CANDIDATES
        eod = self._find(candidates)
        if eod is None:
            raise ConfigError(
                f"`{key}`: tokenizer {where} has none of the EOD tokens {list(candidates)}; add one to its "
                "vocabulary or give a tokenizer that has one"
            )
        self._eod = eod
        pad = self._find(_PAD_CANDIDATES)
        self._pad = self._eod if pad is None else pad
        self._image = self._find(_IMAGE_CANDIDATES)
        self._fingerprint = fingerprint

    def _find(self, candidates: Sequence[str]) -> int | None:
        for tok in candidates:
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                return int(tid)
        return None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def count(self, texts: Sequence[str]) -> np.ndarray:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return self._fingerprint


class HFTokenizer(_RustTokenizer):
    """Megatron's ``HuggingFaceTokenizer``: a ``tokenizer.json`` loaded from disk (never the hub)."""

    def __init__(self, path: str | Path, *, eod_token: str | None = None, key: str = "tokenizer") -> None:
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"`{key}`: tokenizer file {str(p)!r} not found; give the path of a tokenizer.json "
                              "(or of the directory holding it)")
        try:
            tok = _HF.from_file(str(p))
        except Exception as exc:  # the Rust side raises plain Exception for bad JSON
            raise ConfigError(f"`{key}`: cannot load {str(p)!r} as a Hugging Face tokenizer.json: {exc}") from exc
        super().__init__(tok, where=repr(str(p)), fingerprint="hf-" + _digest(p), eod_token=eod_token, key=key)


class GPT2BPETokenizer(_RustTokenizer):
    """Megatron's ``GPT2BPETokenizer``: byte-level BPE from ``vocab.json`` + ``merges.txt``.

    GPT-2's byte-to-unicode alphabet and pre-tokenizing regex (``tokenizers``' ``ByteLevel``),
    no prefix space, EOD ``<|endoftext|>``, as Megatron's ``--vocab-file``/``--merge-file`` give.
    """

    def __init__(self, vocab_file: str | Path, merge_file: str | Path, *, key: str = "tokenizer") -> None:
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers

        vocab, merges = Path(vocab_file), Path(merge_file)
        for what, p in (("vocab file (vocab.json)", vocab), ("merge file (merges.txt)", merges)):
            if not p.is_file():
                raise ConfigError(f"`{key}`: GPT2BPETokenizer {what} {str(p)!r} not found; give the vocab.json path "
                                  "in `tokenizer` and the merges.txt path in `merge_file` (default: beside vocab.json)")
        try:
            tok = _HF(models.BPE.from_file(str(vocab), str(merges)))
        except Exception as exc:  # the Rust side raises plain Exception for bad files
            raise ConfigError(f"`{key}`: cannot load GPT-2 BPE files {str(vocab)!r} + {str(merges)!r}: {exc}") from exc
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        where = f"{str(vocab)!r} + {str(merges)!r}"
        super().__init__(tok, where=where, fingerprint="gpt2bpe-" + _digest(vocab, merges),
                         eod_token="<|endoftext|>", key=key)


class SentencePieceTokenizer(_SpecialIds):
    """Megatron's ``SentencePieceTokenizer``: a SentencePiece ``.model`` file.

    Ids as ``encode_as_ids`` gives them (no BOS/EOS); EOD is the model's EOS id, PAD its pad id
    (EOD when the model has none), the image token ``<image>`` when the model has that piece.
    """

    def __init__(self, path: str | Path, *, key: str = "tokenizer") -> None:
        try:
            import sentencepiece as spm
        except ImportError:
            raise ConfigError(f"`{key}`: {str(path)!r} is a SentencePiece model, which needs sentencepiece: "
                              "pip install 'megascale_data_ext[sentencepiece]'") from None

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.model"
        if not p.is_file():
            raise ConfigError(f"`{key}`: SentencePiece model {str(p)!r} not found; give the path of the .model file")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(p))
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError with its own text
            raise ConfigError(f"`{key}`: cannot load {str(p)!r} as a SentencePiece model: {exc}") from exc
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ConfigError(f"`{key}`: SentencePiece model {str(p)!r} has no EOS piece (eos_id=-1); train it with "
                              "an EOS id (the default --eos_id=2) so documents can end")
        self._eod = eos
        self._pad = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else eos
        image = int(self._sp.piece_to_id("<image>"))
        self._image = None if image == self._sp.unk_id() else image
        self._fingerprint = "sp-" + _digest(p)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int64)

    def count(self, texts: Sequence[str]) -> np.ndarray:
        ids = self._sp.encode(list(texts))
        return np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return self._fingerprint


def infer_tokenizer_type(path: str | Path) -> str:
    """The ``tokenizer_type`` a path implies: ``.model`` → SentencePiece, ``*vocab.json`` → GPT-2
    BPE, other ``.json`` → Hugging Face; a directory by the files it holds."""
    p = Path(path)
    if p.is_dir():
        for name, kind in (("tokenizer.json", "HuggingFaceTokenizer"), ("tokenizer.model", "SentencePieceTokenizer"),
                           ("vocab.json", "GPT2BPETokenizer")):
            if (p / name).is_file():
                return kind
        return "HuggingFaceTokenizer"  # names tokenizer.json in the not-found error
    if p.suffix == ".model":
        return "SentencePieceTokenizer"
    if p.name.endswith("vocab.json"):
        return "GPT2BPETokenizer"
    return "HuggingFaceTokenizer"


def default_merge_file(vocab_file: str | Path) -> Path:
    """Megatron's naming: ``gpt2-vocab.json`` → ``gpt2-merges.txt``; a directory → its ``merges.txt``."""
    p = Path(vocab_file)
    if p.is_dir():
        return p / "merges.txt"
    return p.with_name(p.name.removesuffix("vocab.json") + "merges.txt")


def load_tokenizer(
    path: Any = None,
    *,
    tokenizer_type: str | None = None,
    merge_file: str | os.PathLike[str] | None = None,
    key: str = "tokenizer",
) -> Tokenizer:
    """The tokenizer a path (and optionally a Megatron ``tokenizer_type``) names.

    Args:
        path: ``tokenizer.json`` / SentencePiece ``.model`` / GPT-2 ``vocab.json`` or a directory;
            ``None`` = the byte tokenizer. A :class:`~megascale_data_ext.sources.base.SourceSpec`
            (anything with ``tokenizer``, ``tokenizer_type``, ``merge_file``, ``name``) is read whole.
        tokenizer_type: One of :func:`tokenizer_types`; ``None`` infers it from ``path``.
        merge_file: GPT-2 BPE merges; ``None`` = beside the vocab (Megatron's naming); a relative
            path is taken from the vocab file's directory.
        key: Config key (or command-line flag) that gave ``path``, named in errors.

    Raises:
        ConfigError: An unknown type, a type without its file, or a file that is missing or not a
            tokenizer; the message names ``key`` and the path.
    """
    if hasattr(path, "tokenizer_type"):
        spec = path
        key = f"data.sources.{spec.name}.tokenizer"
        path, tokenizer_type, merge_file = spec.tokenizer, spec.tokenizer_type, spec.merge_file
    type_key = f"{key}-type" if key.startswith("--") else f"{key}_type"  # flag or config key
    if tokenizer_type is not None and tokenizer_type not in tokenizer_types():
        raise ConfigError(f"`{type_key}` must be one of {tokenizer_types()} (Megatron's --tokenizer-type names), "
                          f"got {tokenizer_type!r}")
    if tokenizer_type == "ByteTokenizer" or (tokenizer_type is None and path is None):
        if path is not None:
            raise ConfigError(f"`{key}` is {str(path)!r} but `{type_key}` is ByteTokenizer, which reads no file; "
                              "drop one of them")
        return ByteTokenizer()
    if path is None:
        raise ConfigError(f"`{type_key}` is {tokenizer_type} but `{key}` is not set; give the tokenizer's file")
    kind = tokenizer_type or infer_tokenizer_type(path)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(path, key=key)
    if kind == "GPT2BPETokenizer":
        merges = default_merge_file(path) if merge_file is None else Path(merge_file)
        if not merges.is_absolute() and merge_file is not None:
            merges = (Path(path) if Path(path).is_dir() else Path(path).parent) / merges
        vocab = Path(path) / "vocab.json" if Path(path).is_dir() else Path(path)
        return GPT2BPETokenizer(vocab, merges, key=key)
    return HFTokenizer(path, key=key)
