"""ClientPlaceTree.from_megatron() against a real Megatron parallel_state on 8 gloo ranks.

One torchrun runs every layout in turn (initialize_model_parallel -> check -> destroy), so the
per-rank imports of torch and megatron are paid once; tests/dist/check_placetree.py compares each
rank's tree with Megatron's getters and torch.distributed.get_process_group_ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.launch import TorchrunError, run_torchrun

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
    proc = run_torchrun(SCRIPT, nproc=8, args=args, timeout=300)
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
        run_torchrun(script, nproc=2, args=[], timeout=120)
    assert err.value.returncode not in (0, None)
    assert "hello from rank 0 threads=1" in err.value.output and "hello from rank 1" in err.value.output
