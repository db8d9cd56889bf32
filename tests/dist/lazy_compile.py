"""Defer ``torch.compile``'s import of TorchDynamo/Inductor until a compiled function is first called.

megatron-core decorates its fusions with ``torch.compile`` at import time (``megatron.core.jit``),
and that decoration alone imports ``torch._dynamo`` and ``torch._inductor`` -- about 3 s of CPU
per process, paid by every torchrun rank although these CPU runs never call a fusion (none
compiles in examples/pretrain_gpt.py or tests/dist/train_gpt_cpu.py runs). `install()` replaces
``torch.compile`` with a wrapper whose stand-in calls the real ``torch.compile(fn, **same_arguments)``
on its first call and uses that from then on: if a fusion is ever called, the same compiled function
runs; only the import cost moves to that call.

`run_torchrun(..., lazy_compile=True)` starts each rank through this file, which installs it and
then runs the target unchanged as ``__main__`` (a test's own worker script, an example, or a module)::

    python -m torch.distributed.run ... tests/dist/lazy_compile.py examples/pretrain_gpt.py ARGS
    python -m torch.distributed.run ... tests/dist/lazy_compile.py -m megascale_data_ext.trainer.train_worker ARGS
"""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def deferred(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`compile_fn` (``torch.compile``) made lazy for plain functions: decorating returns a stand-in
    that calls ``compile_fn(fn, **the_same_arguments)`` on its first call and that result from then
    on. Anything else (an ``nn.Module``) is handed to `compile_fn` at once."""

    def lazy(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # decorator with arguments: @torch.compile(mode=...)
            return lambda fn: lazy(fn, **kwargs)
        if not inspect.isfunction(model):
            return compile_fn(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    lazy._lazy_compile = True  # type: ignore[attr-defined]
    return lazy


def install() -> None:
    """Make ``torch.compile`` lazy in this process (idempotent); call before importing megatron."""
    import torch

    if not getattr(torch.compile, "_lazy_compile", False):
        torch.compile = deferred(torch.compile)


def main(argv: list[str]) -> None:
    """``lazy_compile.py SCRIPT ARGS`` or ``lazy_compile.py -m MODULE ARGS``: install, then run it as __main__."""
    install()
    try:
        if argv[:1] == ["-m"]:
            module, rest = argv[1], argv[2:]
            sys.argv = [module, *rest]
            sys.path[0] = os.getcwd()  # as `python -m MODULE` would have it
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, rest = Path(argv[0]).resolve(), argv[1:]
            sys.argv = [str(script), *rest]
            sys.path[0] = str(script.parent)  # as `python SCRIPT` would have it
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    # A test's own worker script ends as the examples do (~1.5 s sooner a rank); an exception
    # other than SystemExit propagates unchanged with its traceback.
    from megascale_data_ext.trainer.app import exit_process

    exit_process(code)


if __name__ == "__main__":
    main(sys.argv[1:])
