"""The one way this package replaces an attribute of megatron-core / Megatron-LM, and undoes it.

Every patch the package makes goes through a `Patches` record: the CPU shims (`patches.cpu`),
the schedule hooks (`megatron.hooks`) and the CP pass-through (`megatron.provider`). A record
replaces an attribute on its owner, or in every loaded module that bound the same object (Megatron
imports functions by name, so ``from megatron.core.utils import f`` holds its own reference),
remembers each original and restores them in reverse order. A replacement carries its original as
``__megascale_original__``, so installing twice wraps the original, never a replacement.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["ORIGINAL", "Patches", "original_of"]

ORIGINAL = "__megascale_original__"


def original_of(fn: Any) -> Any:
    """The function a replacement stands for (`fn` itself when it is not one)."""
    return getattr(fn, ORIGINAL, fn)


def current(owner: Any, attr: str) -> Any:
    """`attr` of `owner` as stored: a class's own ``__dict__`` entry (the exact function object, not
    a bound or re-wrapped one), a module's attribute."""
    return vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)


class Patches:
    """Attribute replacements made so far, undone in reverse order by `undo`."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, attr: str, value: Any) -> None:
        """Replace `owner.attr` with `value`, remembering the original."""
        self._done.append((owner, attr, current(owner, attr)))
        setattr(owner, attr, value)

    def everywhere(self, original: Any, value: Any, attrs: Iterable[str]) -> list[str]:
        """Replace `original` under any of `attrs` in every loaded module; returns ``module.attr`` of each."""
        with contextlib.suppress(AttributeError):  # a builtin or slotted object takes no mark
            setattr(value, ORIGINAL, original)
        done = []
        for mod_name, mod in list(sys.modules.items()):
            for attr in attrs:
                if getattr(mod, attr, None) is original:
                    self.set(mod, attr, value)
                    done.append(f"{mod_name}.{attr}")
        return done

    def undo(self) -> int:
        """Restore every original, newest first; returns how many."""
        n = len(self._done)
        while self._done:
            owner, attr, original = self._done.pop()
            setattr(owner, attr, original)
        return n

    def __len__(self) -> int:
        return len(self._done)
