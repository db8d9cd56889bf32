"""Problems found in a config, each at its config path, collected so one error names them all.

OmegaConf stops at the first bad key or type, while a user fixing a config wants the whole
list: every check adds a :class:`Problem` to :class:`Problems`, which raises one
``ConfigError`` at the end. The runtime dataclasses report ``(field, message)`` pairs;
:meth:`Problems.extend` re-addresses them under the config node they came from.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import FieldProblem, render_problems


class Problem(NamedTuple):
    """One thing wrong: the config path (``data.sources[2].weight``) and what is wrong there."""

    path: str
    message: str


@dataclass(slots=True)
class Problems:
    """Collects problems; a path reported once silences checks at or below it."""

    items: list[Problem] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        if not self.blocked(path):
            self.items.append(Problem(path, message))

    def extend(self, prefix: str, found: Iterable[FieldProblem]) -> None:
        """Add ``(field, message)`` pairs a runtime dataclass reported, at ``prefix.field``."""
        for key, message in found:
            self.add(f"{prefix}.{key}", message)

    def blocked(self, path: str) -> bool:
        """True when ``path`` or a config node above it was already reported."""
        return any(path == p or path.startswith((p + ".", p + "[")) for p, _ in self.items)

    def raise_if_any(self, what: str = "data config") -> None:
        """Raise one ConfigError listing every problem of ``what`` (``path: message`` lines)."""
        if self.items:
            n = len(self.items)
            raise ConfigError(render_problems(f"{what} ({n} problem{'s' * (n > 1)})", self.items))


def did_you_mean(key: str, allowed: Sequence[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of ``allowed``, or ``""``."""
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f"did you mean {close[0]!r}? " if close else ""
