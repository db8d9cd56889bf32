"""Data sources: Parquet, Megatron ``.bin/.idx`` and JSONL readers with sample transforms.

Plain classes (no Ray, no torch): the runtime wraps them in Source Loader actors. The Megatron
``.bin/.idx`` reader is numpy-only (memory-mapped); only `write_indexed_dataset`, used by the
driver for demo and test data, imports Megatron-LM.
"""

from __future__ import annotations

from megascale_data_ext.sources.base import (
    METADATA_KEYS,
    ReadResult,
    Sample,
    SkippedSample,
    Source,
    SourceSpec,
    make_metadata,
    take_metadata,
)
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.formats import SourceFormat, source_formats
from megascale_data_ext.sources.images import decode_patches, image_patch_count, image_patch_grid
from megascale_data_ext.sources.jsonl import JsonlSource
from megascale_data_ext.sources.megatron_indexed import MegatronIndexedSource, write_indexed_dataset
from megascale_data_ext.sources.parquet import ParquetSource
from megascale_data_ext.sources.registry import open_source, register_source_format
from megascale_data_ext.sources.tokenizer import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerType,
    load_tokenizer,
    tokenizer_types,
)
from megascale_data_ext.sources.transforms import DeferredDecoder, decode_images
from megascale_data_ext.sources.writer import PreparedParquetWriter

__all__ = [
    "METADATA_KEYS",
    "ByteTokenizer",
    "DeferredDecoder",
    "GPT2BPETokenizer",
    "HFTokenizer",
    "JsonlSource",
    "MegatronIndexedSource",
    "ParquetSource",
    "PreparedParquetWriter",
    "ReadResult",
    "Sample",
    "SentencePieceTokenizer",
    "SkippedSample",
    "Source",
    "SourceFormat",
    "SourceSpec",
    "Tokenizer",
    "TokenizerType",
    "decode_images",
    "decode_patches",
    "image_patch_count",
    "image_patch_grid",
    "load_tokenizer",
    "make_demo_data",
    "make_metadata",
    "open_source",
    "register_source_format",
    "source_formats",
    "take_metadata",
    "tokenizer_types",
    "write_indexed_dataset",
]
