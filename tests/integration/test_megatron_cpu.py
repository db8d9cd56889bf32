"""megatron-core 0.16.1 on CPU: the shims, the GPT forward step, and real torchrun training.

Fast tests check the shims in-process (apply/remove, RNG stream semantics, the schedule's
``device="cuda"`` redirect) and the forward-step batch contract against a stub model. Slow
tests train a real GPTModel through megatron's pipeline schedules on gloo ranks with packed,
variable-length microbatches; with layout-invariant weights every layout (TP2·PP2, PP2·VPP2,
TP2·DP2) must reproduce a single-process run's losses step for step, and context parallelism
over per-document (THD) attention must reproduce the CP=1 run.

Run as a script (``CP_WORKER=1``) this file is the torchrun worker of the CP test.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megascale_data_ext.errors import ConfigError, ParallelLayoutError, SampleError
from megascale_data_ext.trainer.model import GPTModelConfig, forward_step, stage_batch_keys
from megascale_data_ext.patches import CPU_SHIMS, active_cpu_shims, apply_cpu_shims, remove_cpu_shims
from tests.dist.launch import run_torchrun
from tests.dist.train_gpt_cpu import expected_num_tokens, make_microbatch

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "train_gpt_cpu.py"
STEPS = 10
SEQ, VOCAB = 64, 512
# Every run sees the same global batch: the DP=2 run's 2 x 4 microbatches. Runs with DP=1
# play both DP ranks' data (8 microbatches), so all layouts compare with one reference.
GLOBAL_BATCH_AS_DP1 = ("--emulate-dp", "2", "--num-microbatches", "8")
TOKENS = expected_num_tokens(dp_size=2, num_microbatches=4, step=0, seq_length=SEQ, vocab_size=VOCAB)


@pytest.fixture
def shims() -> Any:
    names = apply_cpu_shims()
    yield names
    remove_cpu_shims()


# --------------------------------------------------------------------------- shims


def test_shims_apply_idempotently_and_remove_restores_originals() -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    remove_cpu_shims()  # a model built earlier in this process (initialize_parallel) leaves them applied
    originals = (torch.cuda.current_device, torch.cuda.synchronize, schedules.torch,
                 fused_softmax.get_default_causal_mask, vars(CudaRNGStatesTracker)["fork"], torch.cuda.current_stream)
    first = apply_cpu_shims()
    try:
        assert first == [s.name for s in CPU_SHIMS] and len(first) == 7
        assert apply_cpu_shims() == first == active_cpu_shims()
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA enabled"
        torch.cuda.current_stream().wait_event(None)  # megatron-core 0.19's grad sync waits on the stream
        assert schedules.torch is not torch
    finally:
        assert remove_cpu_shims() == first
    assert active_cpu_shims() == [] and remove_cpu_shims() == []
    assert (torch.cuda.current_device, torch.cuda.synchronize, schedules.torch,
            fused_softmax.get_default_causal_mask, vars(CudaRNGStatesTracker)["fork"], torch.cuda.current_stream) == originals


def test_schedule_torch_redirects_cuda_factories_only(shims: list[str]) -> None:
    import megatron.core.pipeline_parallel.schedules as schedules

    total = schedules.torch.zeros([], dtype=torch.int, device="cuda")  # the literal in the schedules
    assert total.device.type == "cpu" and total.dtype == torch.int
    assert schedules.torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert schedules.torch.autograd is torch.autograd and schedules.torch.Tensor is torch.Tensor


def test_default_causal_mask_is_upper_triangle_on_cpu(shims: list[str]) -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax

    mask = fused_softmax.get_default_causal_mask(4)
    assert mask.dtype == torch.bool and mask.device.type == "cpu"
    assert torch.equal(mask, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]).bool())


def test_rng_tracker_fork_is_a_separate_cpu_stream(shims: list[str]) -> None:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    with tracker.fork():
        a = torch.rand(3)
    b = torch.rand(3)  # default stream untouched by the fork
    with tracker.fork("model-parallel-rng"):
        c = torch.rand(3)  # the named stream continues where it stopped
    expected = torch.Generator().manual_seed(7)
    assert torch.equal(a, torch.rand(3, generator=expected)) and torch.equal(c, torch.rand(3, generator=expected))
    assert torch.equal(b, torch.rand(3, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(RuntimeError, match="not added"):
        with tracker.fork("expert-parallel-rng"):
            pass
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("other", 7)


# --------------------------------------------------------------- config and forward step


def test_config_reports_every_layout_problem_at_once() -> None:
    with pytest.raises(ParallelLayoutError) as err:
        GPTModelConfig(num_layers=4, num_attention_heads=4, vocab_size=511, tp=3, pp=3, cp=2,
                       attention="dense").validate(world_size=8)
    msg = str(err.value)
    for fragment in ("`num_layers`=4", "num_attention_heads`=4", "`vocab_size`=511", "`cp`=2", "world size 8"):
        assert fragment in msg
    with pytest.raises(ConfigError, match="`position_embedding_type`"):
        GPTModelConfig(position_embedding_type="alibi").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"`attention` must be one of \['auto', 'te', 'flex', 'dense'\]"):
        GPTModelConfig(attention="sdpa").validate()  # type: ignore[arg-type]
    GPTModelConfig(cp=2, attention="flex").validate(world_size=2)  # per-document attention has CP
    GPTModelConfig(tp=2, pp=2).validate(world_size=8)


class _StubStage(torch.nn.Module):
    """Stands in for a GPTModel chunk: records what forward_step passes it."""

    def __init__(self, *, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.calls: list[tuple[Any, ...]] = []
        self.packed: list[Any] = []

    def forward(self, tokens: Any, position_ids: Any, attention_mask: Any, labels: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        self.calls.append((tokens, position_ids, attention_mask, labels))
        self.packed.append(packed_seq_params)
        if labels is None:
            return torch.zeros(1)
        return torch.arange(labels.numel(), dtype=torch.float32).view_as(labels)  # a known "per-token loss"


def test_forward_step_converts_numpy_batches_per_stage() -> None:
    batch = make_microbatch(dp_rank=0, index=1, step=0, seq_length=SEQ, vocab_size=VOCAB)
    only = stage_batch_keys(pre_process=True, post_process=True)
    model = _StubStage(pre_process=True, post_process=True)
    output, loss_fn = forward_step(iter([{k: batch[k] for k in only}]), model)
    tokens, position_ids, mask, labels = model.calls[0]
    assert tokens.dtype == torch.long and torch.equal(tokens, torch.from_numpy(batch["tokens"]))
    assert torch.equal(position_ids, torch.from_numpy(batch["position_ids"]))
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 40, 40)
    assert torch.equal(labels, torch.from_numpy(batch["labels"]))
    loss, num_tokens, report = loss_fn(output)
    weights = batch["loss_mask"].reshape(-1)
    assert num_tokens.dtype == torch.int and int(num_tokens) == int(weights.sum())
    assert float(loss) == pytest.approx(float((np.arange(weights.size) * weights).sum()))
    assert report["lm loss"].tolist() == [pytest.approx(float(loss)), float(num_tokens)]

    middle = _StubStage(pre_process=False, post_process=False)
    forward_step(iter([{"attention_mask": batch["attention_mask"]}]), middle)
    assert middle.calls[0][:2] == (None, None) and middle.calls[0][2].shape == (1, 1, 40, 40)
    forward_step(None, middle)  # no iterator: nothing pulled, plain causal mask downstream
    assert middle.calls[1] == (None, None, None, None)


def test_forward_step_names_missing_keys() -> None:
    last = _StubStage(pre_process=False, post_process=True)
    with pytest.raises(SampleError, match=r"last pipeline stage lacks \['labels', 'loss_mask'\]"):
        forward_step(iter([{"tokens": np.zeros((1, 4), np.int64)}]), last)


# ------------------------------------------------- recipe: schedule, clipping, bf16 mixed precision


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr() -> None:
    from megascale_data_ext.trainer.optimizer import lr_factor

    f = [lr_factor(s, warmup=4, decay=12, min_ratio=0.1, style="cosine") for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0) and f[8] == pytest.approx(0.55) and f[12] == f[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert lr_factor(7, warmup=0, decay=10, min_ratio=0.0, style="constant") == 1.0


def test_step_line_counts_samples_deferred_and_per_source() -> None:
    from types import SimpleNamespace

    from megascale_data_ext.trainer.pretrain import step_counts

    summary = {"samples": 7, "per_source": [3, 4]}
    assert step_counts(summary, SimpleNamespace(samples_per_step=8, tokens_per_step=None)) == \
        "samples 7 (deferred 1) per source [3, 4]"
    assert "(deferred 0)" in step_counts(summary, SimpleNamespace(samples_per_step=8, tokens_per_step=4096))


@pytest.fixture(scope="module")
def one_process() -> Any:
    """torch.distributed with one gloo process and megatron's parallel state (TP=PP=CP=DP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megascale_data_ext.trainer.model import initialize_parallel
    from tests.dist.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    initialize_parallel(GPTModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4))
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    remove_cpu_shims()


def _recipe_run(bf16: bool, clip: float, steps: int = 3) -> tuple[list[dict[str, float]], list[torch.nn.Module], Any]:
    from omegaconf import OmegaConf

    from megascale_data_ext.trainer.model import build_model_chunks, init_layout_invariant
    from megascale_data_ext.trainer.step import train_step
    from megascale_data_ext.trainer.optimizer import build_optimizer

    cfg = GPTModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=SEQ,
                         bf16=bf16)
    chunks = build_model_chunks(cfg)
    init_layout_invariant(chunks, seed=cfg.seed)
    train = OmegaConf.create({"lr": 3e-3, "train_iters": steps, "lr_warmup_iters": 1, "lr_decay_style": "cosine",
                              "min_lr": 3e-4})
    optimizer, scheduler = build_optimizer(chunks, train, bf16=bf16)
    packs = _cp_packs()
    out = [train_step(chunks, optimizer, iter(packs), num_microbatches=len(packs), seq_length=SEQ, clip_grad=clip,
                      scheduler=scheduler) for _ in range(steps)]
    return out, chunks, optimizer


def test_bf16_trains_with_fp32_master_weights_close_to_fp32(one_process: Any) -> None:
    fp32, _, _ = _recipe_run(False, clip=1.0)
    bf16, chunks, optimizer = _recipe_run(True, clip=1.0)
    params = [p for c in chunks for p in c.parameters()]
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {m.dtype for m in optimizer.masters} == {torch.float32}
    assert all(p.main_grad.dtype == torch.float32 for p in params)  # DDP reduces grads in fp32
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    assert bf16[-1]["loss"] < bf16[0]["loss"] and fp32[-1]["loss"] < fp32[0]["loss"]
    assert [r["lr"] for r in fp32] == pytest.approx([3e-3, 3e-3, 1.65e-3])  # warm-up 1, then cosine to min_lr
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)
    assert all(torch.equal(p.float(), m.to(torch.bfloat16).float()) for p, m in zip(params, optimizer.masters))


def test_grad_clipping_scales_the_global_norm_down(one_process: Any) -> None:
    result, chunks, _ = _recipe_run(False, clip=1e-3, steps=1)
    assert result[0]["grad_norm"] > 1e-3  # reported before clipping
    norm = torch.sqrt(sum((p.main_grad.double() ** 2).sum() for c in chunks for p in c.parameters()))
    assert float(norm) == pytest.approx(1e-3, rel=1e-3)


# ------------------------------------------------------------------- torchrun training


def _train(tmp_path: Path, name: str, nproc: int, *args: str, steps: int = STEPS) -> list[dict[str, Any]]:
    out = tmp_path / name
    proc = run_torchrun(SCRIPT, nproc=nproc, timeout=540, preloaded=True,
                        args=["--repeat", "--invariant-init", "--steps", str(steps), "--out", str(out), *args])
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    print(proc.stdout[-2000:])
    for record in records:
        assert record["finite"] and record["shims"] == [s.name for s in CPU_SHIMS]
        assert record["steps"] == records[0]["steps"]  # loss broadcast: every rank reports the same
    return records


def _losses(records: list[dict[str, Any]]) -> list[float]:
    return [step["loss"] for step in records[0]["steps"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Single-process TP1·PP1 run on the global batch."""
    return _train(tmp_path_factory.mktemp("ref"), "ref", 1, "--tp", "1", "--pp", "1", *GLOBAL_BATCH_AS_DP1)


def _assert_matches(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert len(records[0]["steps"]) <= len(reference[0]["steps"])
    for got, want in zip(records[0]["steps"], reference[0]["steps"]):  # a shorter run compares its prefix
        assert got["num_tokens"] == want["num_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], abs=2e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3)


@pytest.mark.slow
def test_tp2_pp2_trains_and_matches_single_process(tmp_path: Path, reference: list[dict[str, Any]]) -> None:
    records = _train(tmp_path, "tp2pp2", 4, "--tp", "2", "--pp", "2", *GLOBAL_BATCH_AS_DP1)
    assert sorted((r["tp_rank"], r["pp_rank"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    losses = _losses(records)
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)  # untrained: uniform over the vocab
    assert losses[-1] < losses[0] - 1.0 and all(b < a for a, b in zip(losses[2:], losses[3:]))
    assert all(step["num_tokens"] == TOKENS for step in records[0]["steps"])
    _assert_matches(records, reference)


@pytest.mark.slow
def test_pp2_vpp2_interleaved_matches_single_process(tmp_path: Path, reference: list[dict[str, Any]]) -> None:
    records = _train(tmp_path, "pp2vpp2", 2, "--tp", "1", "--pp", "2", "--vpp", "2", *GLOBAL_BATCH_AS_DP1, steps=4)
    _assert_matches(records, reference)


@pytest.mark.slow
def test_tp2_dp2_matches_single_process_on_the_same_global_batch(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    records = _train(tmp_path, "tp2dp2", 4, "--tp", "2", "--pp", "1", "--num-microbatches", "4", steps=4)
    assert sorted(r["dp_rank"] for r in records) == [0, 0, 1, 1] and records[0]["dp_size"] == 2
    assert records[0]["steps"][0]["num_tokens"] == TOKENS  # summed over both DP ranks
    _assert_matches(records, reference)


# ------------------------------------------------------------- context parallelism (THD)

def _cp_packs() -> list[dict[str, np.ndarray]]:
    """Two packs of arithmetic-progression documents (uneven lengths, a one-token document)."""
    from megascale_data_ext.dataplane.packing import pack_microbatch

    rng = np.random.default_rng(5)
    packs = []
    for lens in ((13, 5, 22, 1, 9), (17, 30, 6)):
        docs = [{"tokens": (int(rng.integers(0, VOCAB)) + int(rng.integers(1, 5)) * np.arange(n)) % VOCAB}
                for n in lens]
        packs.append(pack_microbatch(docs, seq_length=SEQ, pad_id=0, pad_to_multiple_of=4, variable_length=True))
    return packs


def _tiny_gpt(**layout: Any) -> tuple[list[torch.nn.Module], torch.optim.Optimizer]:
    """A 2-layer GPT over flex attention with a per-token loss, layout-invariant weights, on the
    parallel state `layout` sets up (``cp``, ``hybrid_cp``), and its Adam."""
    from megascale_data_ext.trainer.model import (
        GPTModelConfig, build_model_chunks, init_layout_invariant, initialize_parallel,
    )

    cfg = GPTModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=SEQ,
                         attention="flex", per_token_loss=True, **layout)
    initialize_parallel(cfg)
    chunks = build_model_chunks(cfg)
    init_layout_invariant(chunks, seed=cfg.seed)
    return chunks, torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=3e-3)


def _write_from_rank0(path: Path, results: Any) -> None:
    """Rank 0 writes the JSON the test reads; every rank leaves the process group."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results))
    dist.destroy_process_group()


def _cp_worker(out: Path) -> None:
    """Train 2 steps at CP=2 (flex attention over THD slices), then 2 steps at CP=1 on the same packs.

    The CP=1 phase runs the same 2 processes as DP=2, each rank on the whole packs: with
    per-token loss its gradients (sum over ranks / tokens over ranks) equal one process's.
    """
    from megatron.core import parallel_state as ps

    from megascale_data_ext.dataplane.cp_slicing import slice_for_cp
    from megascale_data_ext.trainer.step import train_step

    torch.set_num_threads(1)
    results: dict[str, list[dict[str, float]]] = {}
    for cp in (2, 1):
        chunks, optimizer = _tiny_gpt(cp=cp)
        rank = ps.get_context_parallel_rank()
        batches = [slice_for_cp(p, cp_size=cp, cp_rank=rank) for p in _cp_packs()]
        results[f"cp{cp}"] = [train_step(chunks, optimizer, iter(batches), num_microbatches=len(batches),
                                         seq_length=SEQ, clip_grad=1.0) for _ in range(2)]
        results[f"cp{cp}_tokens"] = [[int(b["tokens"].shape[1]) for b in batches]]
        ps.destroy_model_parallel()
    _write_from_rank0(out / "cp.json", results)


@pytest.mark.slow
def test_cp2_thd_training_equals_cp1(tmp_path: Path) -> None:
    run_torchrun(Path(__file__), nproc=2, timeout=180, args=[str(tmp_path)], env={"CP_WORKER": "1"}, preloaded=True)
    got = json.loads((tmp_path / "cp.json").read_text())
    packs = _cp_packs()
    # each CP rank holds half of every document padded to a multiple of 2*cp
    assert got["cp2_tokens"] == [[sum(-(-int(n) // 4) * 4 for n in np.diff(p["cu_seqlens"])) // 2 for p in packs]]
    assert got["cp1_tokens"] == [[p["tokens"].shape[1] for p in packs]]
    for cp2, cp1 in zip(got["cp2"], got["cp1"], strict=True):
        loss_tokens = sum(float(p["loss_mask"].sum()) for p in packs)
        assert cp2["num_tokens"] == loss_tokens and cp1["num_tokens"] == 2 * loss_tokens  # CP=1 phase is DP=2
        assert cp2["loss"] == pytest.approx(cp1["loss"], rel=1e-5)
        assert cp2["grad_norm"] == pytest.approx(cp1["grad_norm"], rel=1e-4)
    assert got["cp2"][1]["loss"] < got["cp2"][0]["loss"]  # it trains


# ------------------------------------------------------------- hybrid context parallelism

HYBRID_CAP = 16  # tokens per rank: documents over 16 run on 2 or 4 ranks
HYBRID_LENS = (40, 9, 13, 5, 22, 1, 17, 30, 6, 12, 60, 8, 3, 11, 7, 14, 2, 10)
HYBRID_PP_LENS = (9, 13, 5, 22, 1, 17, 30, 6, 12, 8, 3, 11, 7, 14, 2, 10, 25, 19, 4)  # groups of 1 and 2


def _hybrid_docs() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(9)
    return [{"tokens": (int(rng.integers(0, VOCAB)) + int(rng.integers(1, 5)) * np.arange(n)) % VOCAB}
            for n in HYBRID_LENS]


def _hybrid_worker(out: Path) -> None:
    """4 ranks (DP 2 x CP 2). Hybrid: the planner's plan over the 4 DP x CP ranks, each rank its
    own microbatches, group microbatches THD-sliced for the rank's place in their group. Then the
    same documents at the fixed CP 2 (each DP rank half the documents, every one split over CP 2).
    A per-token loss makes both the same global loss and gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megascale_data_ext.dataplane.balancers.hybrid_cp import CPCost, balance_hybrid_cp
    from megascale_data_ext.dataplane.cp_slicing import slice_for_cp, slice_for_group
    from megascale_data_ext.dataplane.packing import pack_microbatch
    from megascale_data_ext.trainer.step import train_step

    torch.set_num_threads(1)
    docs = _hybrid_docs()
    results: dict[str, Any] = {}
    for hybrid in (True, False):
        chunks, optimizer = _tiny_gpt(cp=2, hybrid_cp=hybrid)
        rank = dist.get_rank()
        if hybrid:
            plan = balance_hybrid_cp(np.array(HYBRID_LENS), 4, HYBRID_CAP, CPCost(linear=1.0, quadratic=0.05))
            batches = [slice_for_group(pack_microbatch([docs[i] for i in mb.docs], seq_length=SEQ, pad_id=0,
                                                       variable_length=True),
                                       group_size=mb.size, rank_in_group=rank - mb.first_gpu)
                       for mb in plan.for_gpu(rank)]
            sizes = [int(b["local_cp_size"]) for b in batches]
        else:
            mine = [docs[i] for i in range(ps.get_data_parallel_rank(), len(docs), 2)]
            groups: list[list[dict[str, np.ndarray]]] = [[]]
            for doc in mine:  # in order, a new pack where the next document (padded for CP 2) would pass SEQ
                if sum(-(-len(d["tokens"]) // 4) * 4 for d in groups[-1] + [doc]) > SEQ:
                    groups.append([])
                groups[-1].append(doc)
            packs = [pack_microbatch(g, seq_length=SEQ, pad_id=0, variable_length=True) for g in groups]
            batches = [slice_for_cp(p, cp_size=2, cp_rank=ps.get_context_parallel_rank()) for p in packs]
            sizes = [2] * len(batches)
        steps = [train_step(chunks, optimizer, iter(list(batches)), num_microbatches=len(batches), seq_length=SEQ,
                            clip_grad=1.0) for _ in range(2)]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sizes)
        results["hybrid" if hybrid else "fixed"] = {"steps": steps, "sizes": gathered}
        ps.destroy_model_parallel()
    # PP 2 x CP 2 (DP 1): hybrid groups of 1 and 2 over the 2 DP x CP ranks of each stage, every
    # group microbatch at one index on both (`HybridPlan.slots`), fillers in the holes; against the
    # fixed CP 2 run of the same documents.
    lens = HYBRID_PP_LENS
    docs = [{"tokens": (7 * i + 3 * np.arange(n)) % VOCAB} for i, n in enumerate(lens)]
    for hybrid in (True, False):
        chunks, optimizer = _tiny_gpt(cp=2, pp=2, hybrid_cp=hybrid)
        if hybrid:
            gpu = ps.get_data_parallel_rank(with_context_parallel=True)
            plan = balance_hybrid_cp(np.array(lens), 2, HYBRID_CAP, CPCost(linear=1.0, quadratic=0.05))
            # in another order than the planner's (whole documents between the groups), so that fillers occur
            plan.microbatches = [plan.microbatches[i] for i in np.random.default_rng(5).permutation(len(plan.microbatches))]
            at = {int(t): mb for t, mb in zip(plan.slots(), plan.microbatches, strict=True) if gpu in mb.gpus()}
            filler = slice_for_group(pack_microbatch([], seq_length=4, pad_id=0, variable_length=True), group_size=1,
                                     rank_in_group=0)
            batches = [slice_for_group(pack_microbatch([docs[i] for i in at[t].docs], seq_length=SEQ, pad_id=0,
                                                       variable_length=True),
                                       group_size=at[t].size, rank_in_group=gpu - at[t].first_gpu)
                       if t in at else filler for t in range(max(at) + 1)]
            sizes = [int(b["local_cp_size"]) if t in at else 0 for t, b in enumerate(batches)]  # 0: a filler
        else:
            batches = [slice_for_cp(p, cp_size=2, cp_rank=ps.get_context_parallel_rank())
                       for p in _greedy_packs(docs, cp=2)]
            sizes = [2] * len(batches)
        steps = [train_step(chunks, optimizer, iter(list(batches)), num_microbatches=len(batches), seq_length=SEQ,
                            clip_grad=1.0) for _ in range(2)]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sizes)
        results["hybrid_pp2" if hybrid else "fixed_pp2"] = {"steps": steps, "sizes": gathered}
        ps.destroy_model_parallel()
    _write_from_rank0(out / "hybrid.json", results)


def _greedy_packs(docs: list[dict[str, np.ndarray]], cp: int) -> list[dict[str, np.ndarray]]:
    """`docs` in order, a new pack where the next document (padded for `cp`) would pass SEQ."""
    from megascale_data_ext.dataplane.packing import pack_microbatch

    groups: list[list[dict[str, np.ndarray]]] = [[]]
    for doc in docs:
        if sum(-(-len(d["tokens"]) // (2 * cp)) * 2 * cp for d in groups[-1] + [doc]) > SEQ:
            groups.append([])
        groups[-1].append(doc)
    return [pack_microbatch(g, seq_length=SEQ, pad_id=0, variable_length=True) for g in groups]


@pytest.mark.slow
def test_hybrid_cp_training_equals_fixed_cp_also_under_pp2(tmp_path: Path) -> None:
    """DP 2 x CP 2 on gloo: with hybrid CP every rank runs its own number of microbatches, short
    documents whole on one rank, long ones over groups of 2 and 4, and trains to the same losses
    and grad norms as the fixed-CP run of the same documents. Then PP 2 x CP 2 in the same ranks
    (megatron-core's 1F1B schedule): groups aligned by index, fillers in the holes, fixed CP's losses."""
    run_torchrun(Path(__file__), nproc=4, timeout=300, args=[str(tmp_path)], env={"HYBRID_WORKER": "1"},
                 preloaded=True)
    got = json.loads((tmp_path / "hybrid.json").read_text())
    sizes = got["hybrid"]["sizes"]
    assert {s for rank in sizes for s in rank} == {1, 2, 4}  # whole, pairs and all four
    assert len({len(rank) for rank in sizes}) > 1  # ranks ran different numbers of microbatches
    for hybrid, fixed in zip(got["hybrid"]["steps"], got["fixed"]["steps"], strict=True):
        assert hybrid["num_tokens"] == fixed["num_tokens"]
        assert hybrid["loss"] == pytest.approx(fixed["loss"], rel=1e-5)
        assert hybrid["grad_norm"] == pytest.approx(fixed["grad_norm"], rel=1e-4)
    # PP 2: the ranks of a stage ran different numbers of microbatches, both groups sizes and fillers
    # occurred, each stage's two ranks (global 0, 1 and 2, 3) alike, and through megatron-core's 1F1B
    # schedule (no deadlock) the losses are fixed CP 2's.
    pp = got["hybrid_pp2"]["sizes"]
    assert pp[0] == pp[2] and pp[1] == pp[3]  # a pipeline's stages run the same list
    assert {s for rank in pp for s in rank} == {0, 1, 2} and pp[0] != pp[1]
    assert [i for i, s in enumerate(pp[0]) if s == 2] == [i for i, s in enumerate(pp[1]) if s == 2]
    for hybrid, fixed in zip(got["hybrid_pp2"]["steps"], got["fixed_pp2"]["steps"], strict=True):
        assert hybrid["num_tokens"] == fixed["num_tokens"]
        assert hybrid["loss"] == pytest.approx(fixed["loss"], rel=1e-5)
        assert hybrid["grad_norm"] == pytest.approx(fixed["grad_norm"], rel=1e-4)
    assert got["hybrid"]["steps"][1]["loss"] < got["hybrid"]["steps"][0]["loss"]


if __name__ == "__main__" and os.environ.get("CP_WORKER"):
    _cp_worker(Path(sys.argv[1]))
if __name__ == "__main__" and os.environ.get("HYBRID_WORKER"):
    _hybrid_worker(Path(sys.argv[1]))
