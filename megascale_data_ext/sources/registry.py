"""Source formats by name: ``open_source(spec)`` builds the reader ``spec.format`` names.

Formats register a factory, so a new format (e.g. WebDataset shards) plugs in without
touching the runtime that calls :func:`open_source` inside its Source Loader actors. The
valid names live in :mod:`~megascale_data_ext.sources.formats`, below the readers.
"""

from __future__ import annotations

from collections.abc import Callable

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.sources.base import Source, SourceSpec
from megascale_data_ext.sources.formats import add_format_name, source_formats
from megascale_data_ext.sources.jsonl import JsonlSource
from megascale_data_ext.sources.megatron_indexed import MegatronIndexedSource
from megascale_data_ext.sources.parquet import ParquetSource
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.webdataset import WebDatasetSource

__all__ = ["SourceFactory", "open_source", "register_source_format", "source_formats"]

SourceFactory = Callable[..., Source]

_FACTORIES: dict[str, SourceFactory] = {}


def register_source_format(fmt: str, factory: SourceFactory) -> None:
    """Register ``factory(spec, tokenizer=...)`` for ``fmt`` (replacing any earlier one)."""
    _FACTORIES[fmt] = factory
    add_format_name(fmt)


def open_source(spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> Source:
    """Open the source ``spec`` describes.

    Args:
        spec: What and where the source is.
        tokenizer: A tokenizer instance to share between sources (loading a Hugging Face
            tokenizer once per loader rather than once per source); ``None`` loads
            ``spec.tokenizer``.

    Raises:
        ConfigError: No reader is registered for the format (lists the registered ones).
        SourceError: The files are missing, corrupt, empty or lack the configured columns.
    """
    factory = _FACTORIES.get(spec.format)
    if factory is None:
        raise ConfigError(f"`data.sources.{spec.name}.format` is {spec.format!r}; "
                          f"registered formats: {sorted(_FACTORIES)}")
    return factory(spec, tokenizer=tokenizer)


register_source_format("parquet", ParquetSource)
register_source_format("megatron", MegatronIndexedSource)
register_source_format("jsonl", JsonlSource)
register_source_format("webdataset", WebDatasetSource)
