"""``python -m torch.distributed.run`` as the tests start it, ending as the ranks end.

The launcher imports torch as well, and its interpreter's exit-time garbage collection walks
every object that import made (~0.5 s a launch on 2 cores, ~35 launches a suite). It runs
torchrun's own ``main`` unchanged and leaves through `trainer.app.exit_process`; an exception
other than ``SystemExit`` (a failed rank) propagates as torchrun raises it.

    python tests/dist/torchrun.py --standalone --nproc_per_node 4 SCRIPT ARGS
"""

from __future__ import annotations

from torch.distributed.run import main

from megascale_data_ext.trainer.app import exit_process

if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        exit_process(e.code)
    exit_process(0)
