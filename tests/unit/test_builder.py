"""MegascaleDatasetBuilder against Megatron's own BlendedMegatronDatasetBuilder on real .bin/.idx data.

Mirrors upstream ``tests/unit_tests/data/test_builder.py``: split sizes, None on ranks that do
not build, blend accuracy, exhaustive unweighted blends, mock data -- and, because the indices
reproduce Megatron's, sample-for-sample equality with Megatron's datasets where Megatron
defines the sample.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from megascale_data_ext.errors import ConfigError, SourceError
from megascale_data_ext.megatron.blend import build_blend_index, document_range
from megascale_data_ext.megatron.builder import MegascaleDatasetBuilder, ltor_masks_and_position_ids
from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

megatron_datasets = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402

VOCAB = 100  # NullTokenizer(VOCAB): eod = VOCAB
SEQ = 16
NUM_SOURCES = 10

try:
    from megatron.core.datasets import helpers_cpp  # noqa: F401

    HELPERS_REASON = None
except ImportError as exc:  # Megatron's builder cannot build indices without its compiled helpers
    HELPERS_REASON = f"megatron.core.datasets.helpers_cpp is not compiled ({exc}); Megatron's builder cannot run"

needs_megatron_helpers = pytest.mark.skipif(HELPERS_REASON is not None, reason=HELPERS_REASON or "")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Ten sources of 40 documents (1..60 tokens + EOD) each."""
    root = tmp_path_factory.mktemp("builder_data")
    rng = np.random.default_rng(7)
    out = []
    for s in range(NUM_SOURCES):
        docs = [np.append(rng.integers(0, VOCAB, rng.integers(1, 60)), VOCAB) for _ in range(40)]
        out.append(write_indexed_dataset(os.path.join(root, f"src{s}"), docs, vocab_size=VOCAB + 1))
    return out


def make_config(**kwargs: object) -> GPTDatasetConfig:
    flags = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
    flags.update(kwargs.pop("flags", {}))  # type: ignore[arg-type]
    # path_to_cache=None: Megatron then caches next to the data and needs no process group.
    return GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, tokenizer=NullTokenizer(VOCAB), **flags, **kwargs)


def ours(sizes: list[int | None], config: GPTDatasetConfig, cls: type = GPTDataset) -> list:
    return MegascaleDatasetBuilder(cls, sizes, lambda: True, config).build()


def megatrons(sizes: list[int | None], config: GPTDatasetConfig, cls: type = GPTDataset) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def assert_same_sample(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


@needs_megatron_helpers
@pytest.mark.parametrize(
    "flags", [{}, {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}])
def test_single_prefix_split_equals_megatron_gpt_dataset(prefixes: list[str], flags: dict) -> None:
    config = make_config(blend=([prefixes[0]], None), split="90,8,2", flags=flags)
    mine, theirs = ours([50, 10, None], config), megatrons([50, 10, None], config)
    assert [len(d) for d in mine[:2]] == [50, 10]  # exactly as requested (Megatron rounds up to whole epochs)
    assert len(mine[2]) == len(theirs[2])  # None: one full epoch of the split
    for split in range(3):
        for i in range(len(mine[split])):
            assert_same_sample(mine[split][i], theirs[split][i])
    assert_same_sample(mine[0][None], theirs[0][None])  # Megatron's padding sample


@needs_megatron_helpers
def test_mock_data_equals_megatron_mock_gpt_dataset() -> None:
    config = make_config()  # no blend -> mock
    assert config.mock
    mine, theirs = ours([20, 7, 3], config, MockGPTDataset), megatrons([20, 7, 3], config, MockGPTDataset)
    assert [len(d) for d in mine] == [20, 7, 3]
    for split in range(3):
        for i in range(len(mine[split])):
            assert_same_sample(mine[split][i], theirs[split][i])


def test_sizes_exact_and_none_on_ranks_that_do_not_build(prefixes: list[str]) -> None:
    weighted = make_config(blend=(prefixes[:3], [0.2, 0.3, 0.5]), split="90,8,2")
    assert [len(d) for d in ours([1000, 37, 5], weighted)] == [1000, 37, 5]
    assert MegascaleDatasetBuilder(GPTDataset, [1000, 37, 5], lambda: False, weighted).build() == [None] * 3
    no_test = make_config(blend=([prefixes[0]], None), split="90,10,0")
    train, valid, test = ours([40, 4, 4], no_test)
    assert (len(train), len(valid), test) == (40, 4, None)


@pytest.mark.parametrize("n", [1000, 997, 10])
def test_blend_accuracy_ten_sources(prefixes: list[str], n: int) -> None:
    weights = np.random.default_rng(3).random(NUM_SOURCES)
    target = n * weights / weights.sum()
    train = ours([n, 5, 5], make_config(blend=(prefixes, weights.tolist()), split="90,8,2"))[0]
    counts = np.bincount(train.dataset_index, minlength=NUM_SOURCES)
    assert counts.sum() == n == len(train)
    assert np.abs(counts - target).max() <= 1.0  # Megatron's bar is 1.2
    for prefix_len in (n // 3, n // 2):  # even spreading: every prefix of the blend tracks the weights too
        prefix_counts = np.bincount(train.dataset_index[:prefix_len], minlength=NUM_SOURCES)
        assert np.abs(prefix_counts - prefix_len * weights / weights.sum()).max() <= 1.2


@needs_megatron_helpers
def test_blend_matches_megatron_builder_per_source(prefixes: list[str]) -> None:
    """Counts as accurate as Megatron's; each source serves Megatron's samples in Megatron's order."""
    n = 1000
    weights = np.random.default_rng(11).random(NUM_SOURCES)
    config = make_config(blend=(prefixes, weights.tolist()), split="90,8,2")
    mine, theirs = ours([n, 10, 5], config)[0], megatrons([n, 10, 5], config)[0]
    target = n * weights / weights.sum()
    mega_counts = np.bincount(theirs.dataset_index[:n], minlength=NUM_SOURCES)
    my_counts = np.bincount(mine.dataset_index, minlength=NUM_SOURCES)
    assert np.abs(mega_counts - target).max() <= 1.2
    assert np.abs(my_counts - target).max() <= np.abs(mega_counts - target).max() + 1e-9
    assert np.abs(my_counts - mega_counts).max() <= 1
    for i in range(0, n, 7):
        source, k = int(mine.dataset_index[i]), int(mine.dataset_sample_index[i])
        sample = mine[i]
        assert int(sample["dataset_id"]) == source
        assert_same_sample({k2: v for k2, v in sample.items() if k2 != "dataset_id"}, theirs.datasets[source][k])


def test_deterministic_by_index_across_builders(prefixes: list[str]) -> None:
    config = make_config(blend=(prefixes[:4], [1, 2, 3, 4]), split="90,8,2")
    a, b = ours([200, 20, 4], config), ours([200, 20, 4], config)
    for split in range(3):
        assert np.array_equal(a[split].dataset_index, b[split].dataset_index)
        for i in reversed(range(len(a[split]))):  # another access order must not matter
            assert_same_sample(a[split][i], b[split][i])
    other_seed = ours([200, 20, 4], _with_seed(config, 99))
    assert any(not torch.equal(a[0][i]["tokens"], other_seed[0][i]["tokens"]) for i in range(20))


def _with_seed(config: GPTDatasetConfig, seed: int) -> GPTDatasetConfig:
    return GPTDatasetConfig(random_seed=seed, sequence_length=SEQ, tokenizer=config.tokenizer, blend=config.blend,
                            split=config.split, reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False)


@needs_megatron_helpers
def test_exhaustive_unweighted_blend_serves_every_sample_once(prefixes: list[str]) -> None:
    config = make_config(blend=(prefixes[:3], None), split="60,20,20")
    mine, theirs = ours([None, None, None], config), megatrons([None, None, None], config)
    for split in range(3):
        blend = mine[split]
        lengths = [len(d) for d in blend.datasets]
        assert len(blend) == sum(lengths) == len(theirs[split])
        pairs = set(zip(blend.dataset_index.tolist(), blend.dataset_sample_index.tolist(), strict=True))
        assert pairs == {(s, k) for s, n in enumerate(lengths) for k in range(n)}  # each exactly once
        assert np.array_equal(np.bincount(blend.dataset_index, minlength=3),
                              np.bincount(theirs[split].dataset_index, minlength=3))
    capped = ours([5, 10_000, None], config)
    assert len(capped[0]) == 5 and len(capped[1]) == sum(len(d) for d in capped[1].datasets)  # capped like Megatron


def test_labels_are_tokens_shifted_and_windows_tile_the_stream(prefixes: list[str]) -> None:
    train = ours([60, 5, 5], make_config(blend=([prefixes[1]], None), split="90,8,2"))[0]
    index = train.index
    for i in range(len(train)):
        sample, text = train[i], train.text(i)
        assert sample["tokens"].shape == sample["labels"].shape == (SEQ,)
        assert sample["tokens"].dtype == sample["labels"].dtype == torch.int64
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["tokens"], torch.from_numpy(text[:-1]))
        assert sample["attention_mask"].shape == (1, SEQ, SEQ) and sample["attention_mask"].dtype == torch.bool
        assert sample["loss_mask"].dtype == torch.float32 and sample["position_ids"].dtype == torch.int64
        # Window s of the shuffled stream starts where window s-1 ended (minus the extra token).
        s = int(index.shuffle_index[i])
        stream = np.concatenate(train.documents.documents(index.document_index))
        assert np.array_equal(text, stream[s * SEQ:s * SEQ + SEQ + 1])


def test_split_assigns_disjoint_document_ranges(prefixes: list[str]) -> None:
    datasets = ours([30, 10, 10], make_config(blend=([prefixes[2]], None), split="50,30,20"))
    for split, (dataset, bookends) in enumerate(zip(datasets, [(0, 0.5), (0.5, 0.8), (0.8, 1.0)], strict=True)):
        begin, end = document_range(bookends, 40)
        assert set(np.unique(dataset.index.document_index).tolist()) == set(range(begin, end)), split


def test_masks_equal_megatrons_with_resets() -> None:
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    rng = np.random.default_rng(0)
    for trial in range(30):
        tokens = torch.from_numpy(rng.integers(0, 6, 24)).long()  # eod=5: several documents, EOD at ends too
        if trial % 3 == 0:
            tokens[-1] = 5
        flags = {"reset_position_ids": bool(trial % 2), "reset_attention_mask": bool(trial % 3),
                 "eod_mask_loss": bool(trial % 5), "create_attention_mask": trial % 7 != 0}
        expected = _get_ltor_masks_and_position_ids(tokens, 5, *flags.values())
        got = ltor_masks_and_position_ids(tokens, 5, **flags)
        for e, g in zip(expected, got, strict=True):
            assert (e is None and g is None) or (torch.equal(e, g) and e.dtype == g.dtype)


def test_clear_errors(prefixes: list[str], tmp_path: object) -> None:
    weighted = make_config(blend=(prefixes[:2], [0.5, 0.5]), split="90,8,2")
    with pytest.raises(ConfigError, match=r"weighted blends need a size.*sizes\[0\]=None"):
        MegascaleDatasetBuilder(GPTDataset, [None, 5, 5], lambda: True, weighted)
    with pytest.raises(ConfigError, match="`sizes` must be 3"):
        MegascaleDatasetBuilder(GPTDataset, [5, 5], lambda: True, weighted)
    tiny = make_config(blend=([prefixes[0]], None), split="969,30,1")  # 40 docs: the test split is empty
    with pytest.raises(SourceError, match="src0.*0 documents.*split"):
        ours([10, 10, 10], tiny)
    assert len(ours([10, 10, None], tiny)[2]) == 0  # a full epoch of nothing is fine
    missing = make_config(blend=([str(tmp_path) + "/nope"], None), split="90,8,2")
    with pytest.raises(SourceError, match="nope"):
        ours([1, 1, 1], missing)
    with pytest.raises(ConfigError, match="non-negative"):
        build_blend_index([1.0, -1.0], 10)
