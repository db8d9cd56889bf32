"""Microbatch transforms: packing, CP slicing (vs Megatron's own), PP stage fields, batch checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megascale_data_ext.dataplane.cp_slicing import thd_padded_length
from megascale_data_ext.dataplane.microbatch import (
    MEGATRON_DTYPES,
    check_megatron_batch,
    fields_for_stage,
    pack_microbatch,
    reassemble_cp,
    slice_for_cp,
)
from megascale_data_ext.errors import ConfigError, ParallelLayoutError, PlanError, SampleError

EOD = 2
PAD = 0
IMG = 99


def doc(length: int, start: int = 10) -> np.ndarray:
    """A document of ``length`` tokens ending with EOD, body tokens never equal to EOD/PAD/IMG."""
    return np.concatenate([np.arange(start, start + length - 1) % 50 + 3, [EOD]]).astype(np.int64)


def reference_mask(seg_lens: list[int]) -> np.ndarray:
    """Block-diagonal causal mask built position by position (True = do not attend)."""
    s = sum(seg_lens)
    seg = [i for i, n in enumerate(seg_lens) for _ in range(n)]
    mask = np.ones((s, s), dtype=bool)
    for q in range(s):
        for k in range(q + 1):
            if seg[q] == seg[k]:
                mask[q, k] = False
    return mask[None, None]


# ---------------------------------------------------------------- packing


def test_pack_exact_fields_with_padding_segment():
    batch = pack_microbatch(
        [{"tokens": [5, 6, EOD]}, SimpleNamespace(tokens=np.array([7, EOD]))], seq_length=8, pad_id=PAD
    )
    np.testing.assert_array_equal(batch["tokens"], [[5, 6, EOD, 7, EOD, PAD, PAD, PAD]])
    np.testing.assert_array_equal(batch["labels"], [[6, EOD, PAD, EOD, PAD, PAD, PAD, PAD]])
    np.testing.assert_array_equal(batch["loss_mask"], [[1, 1, 0, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["position_ids"], [[0, 1, 2, 0, 1, 0, 1, 2]])
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 3, 5, 8])
    np.testing.assert_array_equal(batch["max_seqlen"], [3])
    np.testing.assert_array_equal(batch["num_tokens"], [5])
    assert "attention_mask" not in batch and "images" not in batch
    for key, value in batch.items():
        assert value.dtype == MEGATRON_DTYPES[key], key
    check_megatron_batch(batch)


def test_pack_exact_fit_has_no_padding_segment():
    batch = pack_microbatch([{"tokens": doc(3)}, {"tokens": doc(5)}], seq_length=8, pad_id=PAD)
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 3, 8])
    np.testing.assert_array_equal(batch["max_seqlen"], [5])
    np.testing.assert_array_equal(batch["position_ids"], [[0, 1, 2, 0, 1, 2, 3, 4]])
    assert batch["loss_mask"].sum() == 2 + 4


def test_padding_segment_counts_in_max_seqlen():
    batch = pack_microbatch([{"tokens": doc(2)}], seq_length=8, pad_id=PAD)
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 2, 8])
    np.testing.assert_array_equal(batch["max_seqlen"], [6])


def test_attention_mask_matches_independent_reference():
    lens = [3, 1, 4]
    batch = pack_microbatch([{"tokens": doc(n)} for n in lens], seq_length=11, pad_id=PAD, with_attention_mask=True)
    assert batch["attention_mask"].shape == (1, 1, 11, 11)
    np.testing.assert_array_equal(batch["attention_mask"], reference_mask(lens + [3]))
    check_megatron_batch(batch)


def test_matches_megatron_reset_masks_and_position_ids():
    """Megatron's own reset logic (EOD-delimited docs, non-EOD padding) gives the same mask and positions."""
    torch = pytest.importorskip("torch")
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    lens = [4, 2, 5]
    samples = [{"tokens": doc(n, 7 * n)} for n in lens]
    batch = pack_microbatch(samples, seq_length=14, pad_id=PAD, with_attention_mask=True)
    tokens = torch.from_numpy(batch["tokens"][0].copy())
    mask, _, position_ids = gpt_dataset._get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False, create_attention_mask=True
    )
    np.testing.assert_array_equal(batch["attention_mask"][0], mask.numpy())
    np.testing.assert_array_equal(batch["position_ids"][0], position_ids.numpy())
    # Labels follow GPTDataset's roll(-1) inside each document.
    rolled = torch.roll(tokens, shifts=-1).numpy()
    keep = batch["loss_mask"][0] == 1
    np.testing.assert_array_equal(batch["labels"][0][keep], rolled[keep])


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=0, max_size=6), slack=st.integers(0, 5))
def test_pack_invariants(lens, slack):
    seq_length = sum(lens) + slack or 1
    batch = pack_microbatch([{"tokens": doc(n)} for n in lens], seq_length=seq_length, pad_id=PAD)
    cu = batch["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == seq_length
    assert list(np.diff(cu)) == lens + ([seq_length - sum(lens)] if seq_length > sum(lens) else [])
    assert batch["loss_mask"].sum() == sum(n - 1 for n in lens)
    assert np.all(batch["labels"][batch["loss_mask"] == 0] == PAD)
    assert batch["num_tokens"][0] == sum(lens)
    starts = np.repeat(cu[:-1], np.diff(cu))
    np.testing.assert_array_equal(batch["position_ids"][0], np.arange(seq_length) - starts)
    check_megatron_batch(batch)


def test_variable_length_rounds_up_to_multiple():
    batch = pack_microbatch(
        [{"tokens": doc(3)}, {"tokens": doc(2)}], seq_length=16, pad_id=PAD, pad_to_multiple_of=4, variable_length=True
    )
    assert batch["tokens"].shape == (1, 8)
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 3, 5, 8])
    fixed = pack_microbatch([{"tokens": doc(3)}], seq_length=16, pad_id=PAD, pad_to_multiple_of=4)
    assert fixed["tokens"].shape == (1, 16)


def test_empty_microbatch_is_all_padding():
    batch = pack_microbatch([], seq_length=4, pad_id=PAD, with_attention_mask=True)
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 4])
    assert batch["loss_mask"].sum() == 0 and batch["num_tokens"][0] == 0
    np.testing.assert_array_equal(batch["attention_mask"], reference_mask([4]))


# ---------------------------------------------------------------- VLM


def test_vlm_placeholders_and_image_arrays():
    img_a = np.full((2, 3), 1.0, np.float32)
    img_b = np.full((1, 3), 2.0, np.float32)
    img_c = np.full((3, 3), 3.0, np.float32)
    samples = [
        {"tokens": [5, 6, EOD], "images": [img_a, img_b]},
        {"tokens": [7, EOD]},
        {"tokens": [8, EOD], "images": [img_c]},
    ]
    batch = pack_microbatch(samples, seq_length=16, pad_id=PAD, image_token_id=IMG)
    I = IMG  # noqa: E741
    np.testing.assert_array_equal(batch["tokens"], [[I, I, I, 5, 6, EOD, 7, EOD, I, I, I, 8, EOD, PAD, PAD, PAD]])
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0]])
    expected_labels = [PAD] * 3 + [6, EOD, PAD, EOD, PAD] + [PAD] * 3 + [EOD] + [PAD] * 4
    np.testing.assert_array_equal(batch["labels"], [expected_labels])
    np.testing.assert_array_equal(batch["position_ids"], [[0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3, 4, 0, 1, 2]])
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 6, 8, 13, 16])
    np.testing.assert_array_equal(batch["images"], np.concatenate([img_a, img_b, img_c]))
    np.testing.assert_array_equal(batch["image_seqlens"], [2, 1, 3])
    assert batch["images"].dtype == np.float32 and batch["image_seqlens"].dtype == np.int32
    check_megatron_batch(batch)


def test_vlm_mode_without_images_gives_empty_arrays():
    batch = pack_microbatch([{"tokens": doc(3)}], seq_length=4, pad_id=PAD, image_token_id=IMG)
    assert batch["images"].shape == (0, 0) and batch["images"].dtype == np.float32
    assert batch["image_seqlens"].shape == (0,) and batch["image_seqlens"].dtype == np.int32


def test_images_without_image_token_id_is_config_error():
    with pytest.raises(ConfigError, match="image_token_id"):
        pack_microbatch([{"tokens": doc(3), "images": [np.zeros((2, 4), np.float32)]}], seq_length=8, pad_id=PAD)


def test_mismatched_patch_dims_is_sample_error():
    samples = [{"tokens": doc(2), "images": [np.zeros((1, 4), np.float32), np.zeros((1, 5), np.float32)]}]
    with pytest.raises(SampleError, match="patch_dim"):
        pack_microbatch(samples, seq_length=8, pad_id=PAD, image_token_id=IMG)


# ---------------------------------------------------------------- errors


def test_too_long_sample_names_the_sample():
    samples = [{"tokens": doc(3)}, {"tokens": doc(9), "sample_id": "web/17"}]
    with pytest.raises(PlanError, match=r"sample 1 \(id='web/17'\).*9 positions.*seq_length=8"):
        pack_microbatch(samples, seq_length=8, pad_id=PAD)


def test_truncate_cuts_text_only():
    batch = pack_microbatch([{"tokens": [5, 6, 7, 8, 9, EOD]}], seq_length=4, pad_id=PAD, truncate=True)
    np.testing.assert_array_equal(batch["tokens"], [[5, 6, 7, 8]])
    np.testing.assert_array_equal(batch["labels"], [[6, 7, 8, PAD]])
    np.testing.assert_array_equal(batch["cu_seqlens"], [0, 4])
    vlm = [{"tokens": doc(5), "images": [np.zeros((3, 2), np.float32)]}]
    batch = pack_microbatch(vlm, seq_length=4, pad_id=PAD, image_token_id=IMG, truncate=True)
    np.testing.assert_array_equal(batch["tokens"][0, :3], [IMG] * 3)
    big = [{"tokens": doc(2), "images": [np.zeros((5, 2), np.float32)]}]
    with pytest.raises(PlanError, match="5 image patches"):
        pack_microbatch(big, seq_length=4, pad_id=PAD, image_token_id=IMG, truncate=True)


def test_total_over_seq_length_is_plan_error():
    with pytest.raises(PlanError, match="10 positions > seq_length=8"):
        pack_microbatch([{"tokens": doc(5)}, {"tokens": doc(5)}], seq_length=8, pad_id=PAD, truncate=True)


@pytest.mark.parametrize(
    ("sample", "match"),
    [({"text": [1]}, "no `tokens`"), ({"tokens": [[1, 2]]}, "1-D integer"), ({"tokens": []}, "is empty")],
)
def test_bad_samples_are_sample_errors(sample, match):
    with pytest.raises(SampleError, match=match):
        pack_microbatch([sample], seq_length=8, pad_id=PAD)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="multiple of `pad_to_multiple_of`"):
        pack_microbatch([{"tokens": doc(2)}], seq_length=10, pad_id=PAD, pad_to_multiple_of=4)


# ---------------------------------------------------------------- context parallel


def _megatron_cp_slice(batch: dict[str, np.ndarray], cp_size: int, cp_rank: int, monkeypatch) -> dict:
    torch = pytest.importorskip("torch")
    mutils = pytest.importorskip("megatron.core.utils")
    monkeypatch.setattr(mutils.parallel_state, "get_context_parallel_world_size", lambda: cp_size)
    monkeypatch.setattr(mutils.parallel_state, "get_context_parallel_rank", lambda: cp_rank)
    # Megatron slices every key it gets, so hand it only the sequence fields.
    keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
    torch_batch = {k: torch.from_numpy(batch[k].copy()) for k in keys if k in batch}
    per_sequence = (getattr(mutils, "get_pretrain_batch_on_this_cp_rank", None)  # 0.18; 0.19 made it private
                    or getattr(mutils, "_get_batch_on_this_cp_rank_per_sequence_balancing", None))
    if per_sequence is not None:  # megatron-core >= 0.18: the group's size and rank
        monkeypatch.setattr(mutils.torch.distributed, "get_world_size", lambda group=None: cp_size)
        monkeypatch.setattr(mutils.torch.distributed, "get_rank", lambda group=None: cp_rank)
        return {k: v.numpy() for k, v in per_sequence(torch_batch, object()).items()}
    return {k: v.numpy() for k, v in mutils.get_batch_on_this_cp_rank(torch_batch).items()}


def _one_sequence(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The pack as one SBHD sequence: without document boundaries."""
    return {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    cp_size=st.sampled_from([1, 2, 4]),
    mask=st.booleans(),
)
def test_cp_slice_of_one_sequence_roundtrips_and_equals_megatron(lens, cp_size, mask):
    multiple = 2 * cp_size
    seq_length = -(-sum(lens) // multiple) * multiple
    batch = _one_sequence(pack_microbatch(
        [{"tokens": doc(n)} for n in lens],
        seq_length=seq_length,
        pad_id=PAD,
        with_attention_mask=mask,
        pad_to_multiple_of=multiple,
    ))
    slices = [slice_for_cp(batch, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    rebuilt = reassemble_cp(slices, cp_size)
    assert rebuilt.keys() == batch.keys()
    for key in batch:
        np.testing.assert_array_equal(rebuilt[key], batch[key], err_msg=key)
    with pytest.MonkeyPatch.context() as mp:
        for rank, piece in enumerate(slices):
            theirs = _megatron_cp_slice(batch, cp_size, rank, mp)
            for key, value in theirs.items():
                assert piece[key].dtype == value.dtype, key
                np.testing.assert_array_equal(piece[key], value, err_msg=f"{key} cp_rank={rank}")
            check_megatron_batch(piece, cp_size=cp_size)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    cp_size=st.sampled_from([1, 2, 4]),
    slack=st.integers(0, 9),
)
def test_thd_cp_slices_roundtrip_to_the_pack(lens, cp_size, slack):
    """Per-document padding and zigzag slicing lose nothing (Megatron equality: test_cp_thd.py)."""
    multiple = 2 * cp_size
    seq_length = -(-(sum(lens) + slack) // multiple) * multiple
    batch = pack_microbatch([{"tokens": doc(n)} for n in lens], seq_length=seq_length, pad_id=PAD,
                            pad_to_multiple_of=multiple, source_ids=list(range(len(lens))))
    slices = [slice_for_cp(batch, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    rebuilt = reassemble_cp(slices, cp_size)
    assert rebuilt.keys() == batch.keys()
    for key in batch:
        np.testing.assert_array_equal(rebuilt[key], batch[key], err_msg=key)
    for piece in slices:
        check_megatron_batch(piece, cp_size=cp_size)
        assert piece["tokens"].shape[1] * cp_size == thd_padded_length(batch["cu_seqlens"], cp_size)
    assert sum(int(p["loss_mask"].sum()) for p in slices) == int(batch["loss_mask"].sum())


def test_cp_slice_exact_chunks():
    batch = _one_sequence(pack_microbatch([{"tokens": np.arange(3, 11)}], seq_length=8, pad_id=PAD,
                                          with_attention_mask=True))
    ranks = [slice_for_cp(batch, cp_size=2, cp_rank=r) for r in range(2)]
    np.testing.assert_array_equal(ranks[0]["tokens"], [[3, 4, 9, 10]])
    np.testing.assert_array_equal(ranks[1]["tokens"], [[5, 6, 7, 8]])
    assert ranks[0]["attention_mask"].shape == (1, 1, 4, 8)
    np.testing.assert_array_equal(ranks[0]["attention_mask"][0, 0], batch["attention_mask"][0, 0][[0, 1, 6, 7]])


def test_thd_cp_slice_pads_each_document_and_cuts_it_zigzag():
    batch = pack_microbatch([{"tokens": [3, 4, 5, 6, 7]}, {"tokens": [20, 21, 22]}], seq_length=8, pad_id=PAD,
                            with_attention_mask=True)
    ranks = [slice_for_cp(batch, cp_size=2, cp_rank=r) for r in range(2)]
    # documents padded to 8 and 4 (multiples of 2*cp), padding repeats the last token, loss mask 0
    np.testing.assert_array_equal(ranks[0]["tokens"], [[3, 4, 7, 7, 20, 22]])
    np.testing.assert_array_equal(ranks[1]["tokens"], [[5, 6, 7, 7, 21, 22]])
    np.testing.assert_array_equal(ranks[0]["position_ids"], [[0, 1, 6, 7, 0, 3]])
    np.testing.assert_array_equal(ranks[0]["loss_mask"], [[1, 1, 0, 0, 1, 0]])
    for piece in ranks:
        np.testing.assert_array_equal(piece["cu_seqlens"], [0, 5, 8])
        np.testing.assert_array_equal(piece["cu_seqlens_padded"], [0, 8, 12])
        np.testing.assert_array_equal(piece["max_seqlen"], [8])
        assert "attention_mask" not in piece  # no CP form of the dense mask: attention uses cu_seqlens


def test_cp_errors():
    batch = _one_sequence(pack_microbatch([{"tokens": doc(3)}], seq_length=6, pad_id=PAD))
    with pytest.raises(PlanError, match="pad_to_multiple_of=4"):
        slice_for_cp(batch, cp_size=2, cp_rank=0)
    with pytest.raises(ParallelLayoutError, match="cp_rank"):
        slice_for_cp(batch, cp_size=2, cp_rank=2)
    with pytest.raises(ParallelLayoutError, match="one slice per CP rank"):
        reassemble_cp([batch], 2)
    thd = pack_microbatch([{"tokens": doc(3)}], seq_length=6, pad_id=PAD)
    thd["tokens"] = thd["tokens"][:, :4]
    with pytest.raises(PlanError, match="`tokens` has shape"):
        slice_for_cp(thd, cp_size=2, cp_rank=0)


# ---------------------------------------------------------------- pipeline stages


def _vlm_batch() -> dict[str, np.ndarray]:
    samples = [{"tokens": doc(3), "images": [np.zeros((2, 4), np.float32)]}]
    return pack_microbatch(samples, seq_length=8, pad_id=PAD, image_token_id=IMG, with_attention_mask=True)


def test_fields_for_stage_mapping():
    batch = _vlm_batch()
    assert fields_for_stage(batch, pp_rank=0, pp_size=1).keys() == batch.keys()
    first = fields_for_stage(batch, pp_rank=0, pp_size=4)
    first_fields = {"tokens", "position_ids", "attention_mask", "cu_seqlens", "max_seqlen", "images", "image_seqlens"}
    assert set(first) == first_fields
    assert first["tokens"] is batch["tokens"]
    assert fields_for_stage(batch, pp_rank=1, pp_size=4) == {}
    assert fields_for_stage(batch, pp_rank=2, pp_size=4) == {}
    last = fields_for_stage(batch, pp_rank=3, pp_size=4)
    assert set(last) == {"labels", "loss_mask", "attention_mask", "cu_seqlens", "max_seqlen"}
    assert fields_for_stage(batch, pp_rank=3, pp_size=4, mtp_on_last_stage=True).keys() == batch.keys()
    assert set(fields_for_stage(batch, pp_rank=1, pp_size=2)) == set(last)
    text = pack_microbatch([{"tokens": doc(3)}], seq_length=4, pad_id=PAD)
    assert set(fields_for_stage(text, pp_rank=0, pp_size=2)) == {"tokens", "position_ids", "cu_seqlens", "max_seqlen"}
    for stage in (first, last):
        check_megatron_batch(stage)


def test_fields_for_stage_rejects_bad_rank():
    with pytest.raises(ParallelLayoutError, match="pp_rank"):
        fields_for_stage({}, pp_rank=4, pp_size=4)


# ---------------------------------------------------------------- batch contract


def test_check_megatron_batch_names_every_bad_field():
    batch = pack_microbatch([{"tokens": doc(3)}], seq_length=4, pad_id=PAD, with_attention_mask=True)
    bad = dict(batch, labels=batch["labels"].astype(np.int32), cu_seqlens=batch["cu_seqlens"].astype(np.int64))
    with pytest.raises(SampleError) as info:
        check_megatron_batch(bad)
    assert "`labels` has dtype int32" in str(info.value) and "`cu_seqlens` has dtype int64" in str(info.value)
    with pytest.raises(SampleError, match="`attention_mask` shape"):
        check_megatron_batch(dict(batch, attention_mask=np.zeros((1, 1, 3, 3), bool)))
    with pytest.raises(SampleError, match=r"cu_seqlens\[-1\]"):
        check_megatron_batch(dict(batch, cu_seqlens=np.array([0, 3], np.int32)))
    with pytest.raises(SampleError, match="`max_seqlen`"):
        check_megatron_batch(dict(batch, max_seqlen=np.array(4, np.int32)))
    with pytest.raises(SampleError, match="`loss_mask` has dtype float64"):
        check_megatron_batch(dict(batch, loss_mask=batch["loss_mask"].astype(np.float64)))


def test_check_megatron_batch_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    batch = pack_microbatch([{"tokens": doc(3)}], seq_length=4, pad_id=PAD, with_attention_mask=True)
    check_megatron_batch({k: torch.from_numpy(v) for k, v in batch.items()})
