"""ClientPlaceTree.from_megatron() against a real Megatron parallel_state on 8 gloo ranks.

One torchrun runs every layout in turn (initialize_model_parallel -> check -> destroy), so the
per-rank imports of torch and megatron are paid once; tests/dist/check_placetree.py compares each
rank's tree with Megatron's getters and torch.distributed.get_process_group_ranks. The launcher
itself (tests/dist/launch.py, lazy_compile.py, which the torchrun tests share) is checked here too.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.dist.launch import TorchrunError, run_torchrun
from tests.dist.lazy_compile import deferred

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "check_placetree.py"

LAYOUTS = [
    "tp=2,pp=2",  # TP2 PP2 DP2
    "tp=2,cp=2",  # TP2 CP2 DP2
    "cp=2,pp=2",  # CP2 PP2 DP2
    "pp=8",  # TP1 PP8
    "tp=2,pp=2,vpp=2",  # interleaved schedule
    "tp=2,ep=2",  # MoE: ep folded inside dp=4
    "cp=2,ep=4,etp=1",  # expert tensor parallel differs from tp
    "tp=2,pp=2,ep=2",
    "tp=2,pp=2,order=tp-pp-dp",  # non-default orders Megatron accepts
    "tp=2,pp=2,order=pp-dp-tp",
]


@pytest.mark.slow
def test_from_megatron_matches_parallel_state_for_every_layout() -> None:
    args = [a for layout in LAYOUTS for a in ("--layout", layout)]
    proc = run_torchrun(SCRIPT, nproc=8, args=args, timeout=540, preloaded=True)
    for layout in LAYOUTS:
        assert f"OK [{layout}]" in proc.stdout, proc.stdout[-4000:]
    # The non-default orders were inferred, not defaulted (Megatron does not store the order).
    assert "order='tp-pp-dp'" in proc.stdout and "order='pp-dp-tp'" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("preloaded", [False, True], ids=["torchrun", "preloaded"])
def test_run_torchrun_raises_with_every_ranks_output(tmp_path: Path, preloaded: bool) -> None:
    """Both launchers: a failing rank fails the job with every rank's output; the preloaded one
    (`rank_zygote`) also gives each rank torchrun's environment and kills a job past its timeout."""
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "print(f'hello from rank {rank} of {os.environ[\"WORLD_SIZE\"]} local {os.environ[\"LOCAL_RANK\"]} '\n"
        "      f'threads={os.environ[\"OMP_NUM_THREADS\"]} pid {os.getpid()} run {os.environ[\"TORCHELASTIC_RUN_ID\"]}',\n"
        "      flush=True)\n"
        "time.sleep(600 if 'hang' in sys.argv else 3 if rank == 1 else 0)  # rank 0 printed before the teardown\n"
        "sys.exit(3 if rank == 1 else 0)\n"
    )
    with pytest.raises(TorchrunError) as err:
        run_torchrun(script, nproc=2, args=[], timeout=540, preloaded=preloaded)
    assert err.value.returncode not in (0, None)
    out = err.value.output
    assert "hello from rank 0 of 2 local 0 threads=1" in out and "hello from rank 1 of 2 local 1" in out
    assert len({line.split(" run ")[1] for line in out.splitlines() if line.startswith("hello")}) == 1  # one job
    if preloaded:
        with pytest.raises(TorchrunError, match="timed out after 5") as err:
            run_torchrun(script, nproc=2, args=["hang"], timeout=5, preloaded=True)
        assert err.value.returncode is None and "hello from rank 1 of 2" in err.value.output
        pids = [int(line.split(" pid ")[1].split()[0]) for line in err.value.output.splitlines() if " pid " in line]
        deadline = time.monotonic() + 60  # SIGKILLed: a process that imported torch takes a moment to exit
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pids) == 2 and not any(_running(pid) for pid in pids)  # the timeout killed the ranks too


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed rank whose parent died may wait unreaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_lazy_compile_compiles_each_function_on_its_first_call_with_its_arguments() -> None:
    """tests/dist/lazy_compile.py, how the torchrun tests start their ranks: a decorated function is
    compiled by the real torch.compile (here a recording stand-in) when first called, not when decorated."""
    calls: list[tuple[str, dict]] = []

    def real_compile(model, **kwargs):
        calls.append((getattr(model, "__name__", type(model).__name__), kwargs))
        return lambda *args, **kw: ("compiled", model(*args, **kw))

    lazy = deferred(real_compile)

    @lazy
    def plus_one(x):
        return x + 1

    twice = lazy(mode="max-autotune")(lambda x: 2 * x)
    assert calls == [] and plus_one.__name__ == "plus_one"
    assert plus_one(1) == ("compiled", 2) and plus_one(2) == ("compiled", 3) and twice(3) == ("compiled", 6)
    assert calls == [("plus_one", {}), ("<lambda>", {"mode": "max-autotune"})]  # once each, as decorated

    class Module:
        def __call__(self, x):
            return x

    lazy(Module(), fullgraph=True)  # not a function (an nn.Module): compiled at once
    assert calls[-1] == ("Module", {"fullgraph": True})
