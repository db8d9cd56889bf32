"""THD context parallelism: every CP rank's share equals Megatron's ``get_thd_batch_on_this_cp_rank``.

Megatron-LM's ``get_batch`` hands a packed batch with ``cu_seqlens`` to megatron-core's
``get_thd_batch_on_this_cp_rank``; the tests call that real function on the per-document padded
pack and compare tokens, labels, loss mask, position ids, source ids and the THD metadata with
what `slice_for_cp` (and, end to end, the Data Constructor) gives each CP rank.

The one piece of that function that is not megatron-core's Python is the index of the tokens a
rank keeps: ``transformer_engine_torch.thd_get_partitioned_indices``, a CUDA kernel (Transformer
Engine cannot be imported on a CPU-only machine). The stand-in below reimplements nothing: it
asks megatron-core's own THD RoPE code (``_get_thd_freqs_on_this_cp_rank``, which must pick the
same positions as TE or RoPE would rotate the wrong tokens under CP) which positions of an
``arange`` each document contributes to the rank. Where TE and CUDA are present, the real kernel
is compared too.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megascale_data_ext.dataplane.microbatch import check_megatron_batch, pack_microbatch, pad_for_cp, slice_for_cp
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.trainer.attention import packed_seq_params

mutils = pytest.importorskip("megatron.core.utils")
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "source_ids")


def rope_partition(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions megatron-core's THD RoPE gives CP rank ``cp_rank``: TE's partition, by contract."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    positions = torch.arange(total_tokens).view(-1, 1, 1, 1)
    cu = cu_seqlens_padded.tolist()
    pieces = [_get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, torch.empty((b - a) // cp_size), positions, a)
              for a, b in zip(cu, cu[1:], strict=False)]
    return torch.cat(pieces).view(-1) if pieces else torch.zeros(0, dtype=torch.long)


def megatron_thd_slice(padded: dict[str, np.ndarray], cp_size: int, cp_rank: int, monkeypatch, *, tex=None):
    """megatron-core's get_thd_batch_on_this_cp_rank on a padded pack: (fields, PackedSeqParams)."""
    if tex is None:
        monkeypatch.setattr(mutils, "tex", SimpleNamespace(thd_get_partitioned_indices=rope_partition))
        monkeypatch.setattr(mutils, "is_te_min_version", lambda *a, **k: True)
    batch = {k: torch.from_numpy(np.ascontiguousarray(padded[k])) for k in SEQUENCE_KEYS if k in padded}
    cu = torch.from_numpy(padded["cu_seqlens"].astype(np.int32))
    cu_pad = torch.from_numpy(padded["cu_seqlens_padded"].astype(np.int32))
    if not hasattr(mutils, "get_thd_batch_on_this_cp_rank"):  # megatron-core >= 0.18: the fields only
        monkeypatch.setattr(mutils.torch.distributed, "get_world_size", lambda group=None: cp_size)
        monkeypatch.setattr(mutils.torch.distributed, "get_rank", lambda group=None: cp_rank)
        per_document = (getattr(mutils, "get_sft_batch_on_this_cp_rank", None)  # 0.18; 0.19 made it private
                        or mutils._get_batch_on_this_cp_rank_per_document_balancing)
        fields = per_document({**batch, "cu_seqlens": cu[None], "cu_seqlens_padded": cu_pad[None]}, cp_group=object())
        sliced = ("tokens", "labels", "loss_mask", "position_ids")  # what 0.18 slices (not our source_ids)
        return {k: v.numpy() for k, v in fields.items() if k in sliced}, None
    fields, params = mutils.get_thd_batch_on_this_cp_rank(batch, cu, cu_pad, torch.from_numpy(padded["max_seqlen"]),
                                                          cp_size=cp_size, cp_rank=cp_rank)
    return {k: v.numpy() for k, v in fields.items()}, params


def assert_rank_equals_megatron(piece: dict, theirs: dict, params, rank: int) -> None:
    for key, value in theirs.items():
        assert piece[key].dtype == value.dtype, key
        np.testing.assert_array_equal(piece[key], value, err_msg=f"{key} cp_rank={rank}")
    if params is None:  # megatron-core >= 0.18 slices the fields and builds no PackedSeqParams there
        return
    ours = packed_seq_params(piece, "cpu")  # what our forward_step hands the model
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        torch.testing.assert_close(getattr(ours, name), getattr(params, name), msg=f"{name} cp_rank={rank}")
    assert (ours.qkv_format, ours.max_seqlen_q, ours.max_seqlen_kv) == ("thd", params.max_seqlen_q,
                                                                         params.max_seqlen_kv)


def _pack(lens: list[int], cp_size: int, slack: int) -> dict[str, np.ndarray]:
    mult = 2 * cp_size
    rng = np.random.default_rng(sum(lens) + slack)
    docs = [{"tokens": rng.integers(3, 500, size=n)} for n in lens]
    seq = -(-(sum(lens) + slack) // mult) * mult
    return pack_microbatch(docs, seq_length=max(seq, mult), pad_id=0, pad_to_multiple_of=mult, variable_length=True,
                           source_ids=[i % 3 for i in range(len(lens))])


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(1, 23), min_size=1, max_size=6), cp_size=st.sampled_from([2, 3, 4]),
       slack=st.integers(0, 12))
def test_every_cp_rank_equals_megatron_thd_slicing(lens, cp_size, slack):
    batch = _pack(lens, cp_size, slack)
    padded = pad_for_cp(batch, cp_size=cp_size)
    check_megatron_batch(padded)  # every padded document divides by 2*cp: TE can partition it
    assert not np.any(np.diff(padded["cu_seqlens_padded"]) % (2 * cp_size))
    with pytest.MonkeyPatch.context() as mp:
        for rank in range(cp_size):
            piece = slice_for_cp(batch, cp_size=cp_size, cp_rank=rank)
            theirs, params = megatron_thd_slice(padded, cp_size, rank, mp)
            assert_rank_equals_megatron(piece, theirs, params, rank)


@pytest.mark.skipif(not (torch.cuda.is_available() and getattr(mutils, "tex", None) is not None),
                    reason="Transformer Engine's CUDA partition kernel needs TE and a GPU")
def test_rope_partition_equals_transformer_engine_kernel():
    cu = torch.tensor([0, 8, 12, 36, 40], dtype=torch.int32, device="cuda")
    for rank in range(2):
        te = mutils.tex.thd_get_partitioned_indices(cu, 40, 2, rank)
        torch.testing.assert_close(te.cpu().long(), rope_partition(cu.cpu(), 40, 2, rank))


@pytest.fixture(scope="module")
def cp_service(tmp_path_factory):
    from megascale_data_ext.runtime.config import ServiceConfig
    from megascale_data_ext.runtime.inprocess import InProcessService
    from megascale_data_ext.sources.demo_data import make_demo_data

    specs = make_demo_data(tmp_path_factory.mktemp("demo"), seed=5, rows=60, image_rows=0, text_sources=2,
                           image_sources=0, megatron_source=False)
    specs = [dataclasses.replace(s, truncate=True, max_tokens=301) for s in specs]  # several documents per pack
    tree = ClientPlaceTree.from_sizes(cp=2, dp=2)
    cfg = ServiceConfig(sources=specs, seed=7, samples_per_step=16, num_microbatches=2, seq_length=1024,
                        strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64,
                        with_attention_mask=False)
    return InProcessService(cfg, tree), tree


def test_constructor_gives_every_cp_rank_megatrons_thd_slice(cp_service):
    """End to end: the Data Constructor's per-rank microbatches, against Megatron on its whole pack."""
    service, tree = cp_service
    cons = service.constructors[0]
    compared, segments = 0, 0
    with pytest.MonkeyPatch.context() as mp:
        for j in range(2):
            whole = cons.packed(0, 0, j)
            segments += int(np.diff(whole["cu_seqlens"]).size)
            padded = pad_for_cp(whole, cp_size=2)
            for cp in range(2):
                piece, _ = cons.get(0, j, tree.rank_of(cp=cp, dp=0))
                theirs, params = megatron_thd_slice(padded, 2, cp, mp)
                assert_rank_equals_megatron(piece, theirs, params, cp)
                check_megatron_batch(piece, cp_size=2)
                compared += 1
    assert compared == 4 and segments >= 6  # real packs of several documents
