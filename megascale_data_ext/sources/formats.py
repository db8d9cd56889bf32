"""Source format names: the built-in ones and those plugged in through ``register_source_format``.

Only the names live here (no reader is imported), so :class:`~megascale_data_ext.sources.base.
SourceSpec` can validate ``format`` while :mod:`~megascale_data_ext.sources.registry`, which
imports the readers (and they import ``base``), maps the names to the readers' factories.
"""

from __future__ import annotations

from typing import Literal, get_args

#: The formats this package reads; ``registry`` registers a reader for each.
SourceFormat = Literal["parquet", "megatron", "jsonl", "webdataset"]

_PLUGGED: set[str] = set()


def add_format_name(fmt: str) -> None:
    """Make ``fmt`` a valid ``SourceSpec.format`` (``register_source_format`` calls this)."""
    _PLUGGED.add(fmt)


def source_formats() -> list[str]:
    """Every valid format name, sorted: the built-in ones and the plugged-in ones."""
    return sorted({*get_args(SourceFormat), *_PLUGGED})
