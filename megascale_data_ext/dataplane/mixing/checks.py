"""Validation shared by the schedules and the Mixer: weight lists, source names, counts.

Each check appends what is wrong to a list of problems, so one `ConfigError` names them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError

__all__ = ["check_weights", "is_count", "names_hint", "names_tuple", "raise_problems", "weights_length"]


def names_hint(names: Sequence[str] | None, n: int) -> str:
    """The sources as an error names them: their names, else their count."""
    return f"sources: {list(names)}" if names is not None else f"{n} sources"


def check_weights(
    field_name: str, weights: Any, names: Sequence[str] | None, problems: list[str], *, num_sources: int | None = None
) -> np.ndarray | None:
    """Return ``weights`` normalised to sum 1, or append what is wrong to ``problems``."""
    try:
        arr = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        problems.append(f"`{field_name}` must be a list of numbers, got {weights!r}")
        return None
    n = num_sources if num_sources is not None else (len(names) if names is not None else None)
    if arr.ndim != 1 or arr.size == 0:
        problems.append(f"`{field_name}` must be a non-empty list of numbers, got {weights!r}")
        return None
    if n is not None and arr.size != n:
        problems.append(
            f"`{field_name}` has {arr.size} entries but there are {n} sources, got {arr.tolist()!r} "
            f"({names_hint(names, n)})"
        )
        return None
    if not np.all(np.isfinite(arr)) or np.any(arr < 0) or arr.sum() <= 0:
        problems.append(
            f"`{field_name}` must be non-negative and sum to > 0, got {arr.tolist()!r} ({names_hint(names, arr.size)})"
        )
        return None
    return arr / arr.sum()


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one ConfigError listing every problem found in `what`, if any."""
    if problems:
        raise ConfigError(f"invalid {what}: " + "; ".join(problems))


def names_tuple(source_names: Sequence[str] | None) -> tuple[str, ...] | None:
    """The source names as a tuple of str (None stays None); ConfigError on duplicates."""
    if source_names is None:
        return None
    names = tuple(str(n) for n in source_names)
    if len(set(names)) != len(names):
        raise ConfigError(f"`source_names` must be unique, got {list(names)}")
    return names


def weights_length(values: Any) -> int | None:
    """Length of a would-be weight list (None if it is not one; ``check_weights`` says why)."""
    return len(values) if isinstance(values, Sequence | np.ndarray) and not isinstance(values, str) else None


def is_count(value: Any) -> bool:
    """Whether `value` is a non-negative int (bool excluded), e.g. a step or a batch size."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= 0
