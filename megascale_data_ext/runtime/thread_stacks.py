"""Where a silent actor's threads are, asked when a caller gives up on it.

A call that times out on a live actor is a deadlock or a stall, and Ray's error says only that
it timed out. Every service actor answers `thread_stacks` on a thread of its own (the Ray
concurrency group `DIAGNOSTICS_GROUP`, which `runtime.ray_actor` adds to any class with the
method), so an actor whose other threads are all blocked still says where they are. A caller
that gives up attaches the answer to its error as a note (`note_thread_stacks`): the error line
stays one line, and the traceback in the log names the frames that waited. Run 104's stalled
loader (fixed in 49be066) had to be diagnosed from the code; this would have named it.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

import ray

__all__ = ["DIAGNOSTICS_GROUP", "ThreadStacks", "format_thread_stacks", "note_thread_stacks"]

DIAGNOSTICS_GROUP = "diagnostics"
ASK_SECONDS = 10.0  # how long a caller that already gave up waits for the stacks


def format_thread_stacks(*, frames: int = 12) -> str:
    """Every thread of this process but the caller's, by name, each with its innermost `frames` frames."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = "".join(traceback.format_stack(frame)[-frames:])
        out.append(f"thread {names.get(ident, ident)!s}:\n{stack}")
    return "\n".join(out)


class ThreadStacks:
    """Mixin for an actor façade: `thread_stacks`, answered even when every other thread waits."""

    @ray.method(concurrency_group=DIAGNOSTICS_GROUP)
    def thread_stacks(self) -> str:
        return format_thread_stacks()


def note_thread_stacks(error: BaseException, handle: Any, name: str, *, seconds: float = ASK_SECONDS) -> None:
    """Add `handle`'s thread stacks to `error` as a note (shown with its traceback, not in its line);
    say so in the note when the actor cannot answer either (dead, restarting, or its process stuck)."""
    try:
        stacks = ray.get(handle.thread_stacks.remote(), timeout=seconds)
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not replace the error it explains
        error.add_note(f"{name} did not say where its threads were either ({type(exc).__name__})")
        return
    error.add_note(f"threads of {name} when its caller gave up:\n{stacks}")
