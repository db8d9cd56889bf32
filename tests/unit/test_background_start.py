"""Rank 0 starts the service in the background while the model is built: `finish_serve` hands every
rank the handles, or the start-up's own error (one process group of one rank here)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch.distributed as dist

from megascale_data_ext.errors import SourceError
from megascale_data_ext.trainer.pretrain import finish_serve


@pytest.fixture
def one_rank(tmp_path):
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


def test_the_handles_of_the_background_start_reach_the_rank(one_rank) -> None:
    done: Future = Future()
    done.set_result({"address": "10.0.0.1:6379"})
    handles, waited = finish_serve(done)
    assert handles == {"address": "10.0.0.1:6379"} and waited >= 0.0


def test_a_failed_background_start_raises_its_root_cause_on_the_rank(one_rank) -> None:
    failed: Future = Future()
    cause = SourceError("source 'web' is empty (paths: ['x']); remove it or give it data")
    from ray.exceptions import RayTaskError

    failed.set_exception(RayTaskError("PlannerActor.loader_actors", "Traceback ...\n" * 50, cause))  # 1 actor hop
    with pytest.raises(SourceError, match="source 'web' is empty"):
        finish_serve(failed)
    with pytest.raises(ConnectionError, match="data.ray.address"):  # Ray itself could not start
        finish_serve(ConnectionError("cannot reach `data.ray.address`=10.0.0.9:6379"))
