"""ClientPlaceTree.from_megatron() against a real Megatron parallel_state on 8 gloo ranks.

One torchrun runs every layout in turn (initialize_model_parallel -> check -> destroy), so the
per-rank imports of torch and megatron are paid once; tests/dist/check_placetree.py compares each
rank's tree with Megatron's getters and torch.distributed.get_process_group_ranks. The launcher
itself (tests/dist/launch.py, lazy_compile.py, which the torchrun tests share) is checked here too.
"""

from __future__ import annotations

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
def test_run_torchrun_raises_with_every_ranks_output(tmp_path: Path) -> None:
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "print(f'hello from rank {rank} threads={os.environ[\"OMP_NUM_THREADS\"]}', flush=True)\n"
        "time.sleep(3 if rank == 1 else 0)  # rank 0 has printed before torchrun tears the job down\n"
        "sys.exit(3 if rank == 1 else 0)\n"
    )
    with pytest.raises(TorchrunError) as err:
        run_torchrun(script, nproc=2, args=[], timeout=540)
    assert err.value.returncode not in (0, None)
    assert "hello from rank 0 threads=1" in err.value.output and "hello from rank 1" in err.value.output


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
