"""MegascaleDatasetBuilder against Megatron's own BlendedMegatronDatasetBuilder on real .bin/.idx data.

The contract of Megatron-LM core_v0.16.1's ``tests/unit_tests/data/test_builder.py`` (which
``scripts/check_megatron_builder_suite.sh`` runs verbatim against this builder), checked here
against Megatron's builder itself: the same types (``GPTDataset``, ``MockGPTDataset``,
``BlendedDataset``), lengths, per-source counts (also where ``N * w`` is fractional), index
arrays and samples, the same refusals, and delegation of other dataset classes.
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.blended_dataset import BlendedDataset  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.core.datasets.megatron_dataset import MegatronDataset  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402

from megascale_data_ext.errors import ConfigError, SourceError  # noqa: E402
from megascale_data_ext.megatron.blend import blend_sizes, build_blend_index, document_range, normalize  # noqa: E402
from megascale_data_ext.megatron.builder import (  # noqa: E402
    BlendOversampledError,
    BuilderArgumentError,
    MegascaleDatasetBuilder,
    ltor_masks_and_position_ids,
)
from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset  # noqa: E402

VOCAB = 100  # NullTokenizer(VOCAB): eod = VOCAB
SEQ = 16
NUM_SOURCES = 10

try:
    from megatron.core.datasets import helpers_cpp

    HELPERS_REASON = None
except ImportError as exc:  # Megatron's builder cannot build indices without its compiled helpers
    helpers_cpp = None
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


def assert_same_gpt(mine: GPTDataset, theirs: GPTDataset, *, every: int = 1) -> None:
    """Same type, length, index arrays (dtype too) and samples as Megatron's GPTDataset."""
    assert isinstance(mine, type(theirs)) and len(mine) == len(theirs) and mine.num_samples == theirs.num_samples
    for name in ("document_index", "sample_index", "shuffle_index"):
        a, b = getattr(mine, name), getattr(theirs, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for i in range(0, len(mine), every):
        assert_same_sample(mine[i], theirs[i])


def assert_same_blend(mine: BlendedDataset, theirs: BlendedDataset) -> None:
    assert isinstance(mine, BlendedDataset) and len(mine) == len(theirs) and mine.size == theirs.size
    assert mine.weights == theirs.weights
    assert np.array_equal(mine.dataset_index, theirs.dataset_index)
    assert np.array_equal(mine.dataset_sample_index, theirs.dataset_sample_index)
    for a, b in zip(mine.datasets, theirs.datasets, strict=True):
        assert_same_gpt(a, b, every=max(1, len(a) // 5))


@needs_megatron_helpers
@pytest.mark.parametrize(
    "flags", [{}, {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}])
def test_single_prefix_split_equals_megatron_gpt_dataset(prefixes: list[str], flags: dict) -> None:
    config = make_config(blend=([prefixes[0]], None), split="90,8,2", flags=flags)
    mine, theirs = ours([50, 10, None], config), megatrons([50, 10, None], config)
    for split in range(3):  # lengths are Megatron's: whole epochs, at least the size asked for
        assert_same_gpt(mine[split], theirs[split])
    assert len(mine[0]) >= 50 and len(mine[1]) >= 10
    assert_same_sample(mine[0][None], theirs[0][None])  # Megatron's padding sample


@needs_megatron_helpers
@pytest.mark.parametrize("extra", [True, False])
def test_partial_validation_sequence_and_split_sentences_equal_megatron(tmp_path: object, extra: bool) -> None:
    """Multi-sequence documents (--split-sentences) split by sequence; a kept partial last sample."""
    prefix = os.path.join(str(tmp_path), "sentences")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(VOCAB + 1))
    rng = np.random.default_rng(5)
    for _ in range(30):
        lengths = rng.integers(1, 12, rng.integers(1, 4)).tolist()
        builder.add_document(rng.integers(0, VOCAB, sum(lengths)), lengths)
    builder.finalize(prefix + ".idx")
    # eod_mask_loss: Megatron then does not cache masks. With caching, its first call stores the
    # loss mask it then zeroes in place, so a padded first sample masks every later one (not copied).
    config = make_config(blend=([prefix], None), split="60,30,10", drop_last_partial_validation_sequence=False,
                         add_extra_token_to_sequence=extra, flags={"eod_mask_loss": True})
    mine, theirs = ours([40, None, 7], config), megatrons([40, None, 7], config)
    for split in range(3):
        assert_same_gpt(mine[split], theirs[split])
    padded = [i for i in range(len(mine[1])) if (mine[1].text(i) == -1).any()]
    assert len(padded) == 1 and mine[1][padded[0]]["loss_mask"][-1] == 0  # the kept partial sample


@needs_megatron_helpers
def test_mock_data_equals_megatron_mock_gpt_dataset() -> None:
    # No blend -> mock: 100,000 synthetic documents (205M tokens); long samples keep the epoch small.
    config = GPTDatasetConfig(random_seed=1234, sequence_length=2048, tokenizer=NullTokenizer(VOCAB),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False)
    assert config.mock
    mine, theirs = ours([20, 7, 3], config, MockGPTDataset), megatrons([20, 7, 3], config, MockGPTDataset)
    for split in range(3):
        assert_same_gpt(mine[split], theirs[split], every=len(mine[split]) // 20 + 1)


@needs_megatron_helpers
@pytest.mark.parametrize("n", [997, 1000, 10])
def test_fractional_weighted_blend_has_megatrons_size_counts_and_order(prefixes: list[str], n: int) -> None:
    """N * w fractional: the blend has sum(ceil(N * w)) samples, Megatron's counts and order."""
    weights = [0.37, 0.41, 0.22]
    config = make_config(blend=(prefixes[:3], weights), split="90,8,2")
    mine, theirs = ours([n, 11, 3], config), megatrons([n, 11, 3], config)
    used, built = blend_sizes(normalize(weights), n, 0.005)
    assert len(mine[0]) == sum(used) and [len(d) >= b for d, b in zip(mine[0].datasets, built, strict=True)]
    if n == 997:
        assert sum(used) == 998 and used == [369, 409, 220]
    for split in range(3):
        assert_same_blend(mine[split], theirs[split])
        counts = np.bincount(theirs[split].dataset_index, minlength=3)
        assert np.array_equal(mine[split].counts, counts)
        assert [int(d["dataset_id"]) for d in (mine[split][0], mine[split][len(mine[split]) - 1])] == [
            int(theirs[split].dataset_index[0]), int(theirs[split].dataset_index[-1])]


@needs_megatron_helpers
def test_ten_source_blend_and_per_split_blends_equal_megatron(prefixes: list[str]) -> None:
    weights = np.random.default_rng(11).random(NUM_SOURCES).tolist()
    config = make_config(blend=(prefixes, weights), split="90,8,2")
    for mine, theirs in zip(ours([1000, 10, 5], config), megatrons([1000, 10, 5], config), strict=True):
        assert_same_blend(mine, theirs)
        assert np.abs(mine.counts - len(mine) * np.asarray(mine.weights)).max() <= 1.2  # Megatron's own bar
    per_split = make_config(blend_per_split=[(prefixes[:4], [1, 2, 3, 4]), (prefixes[4:6], None), ([prefixes[6]], [5])])
    mine, theirs = ours([300, 20, 9], per_split), megatrons([300, 20, 9], per_split)
    assert_same_blend(mine[0], theirs[0])
    assert_same_blend(mine[1], theirs[1])  # unweighted, capped at the size
    assert_same_gpt(mine[2], theirs[2])  # one prefix: a GPTDataset, the weight ignored as Megatron ignores it


@needs_megatron_helpers
def test_exhaustive_unweighted_blend_equals_megatron(prefixes: list[str]) -> None:
    config = make_config(blend=(prefixes[:3], None), split="60,20,20")
    mine, theirs = ours([None, None, None], config), megatrons([None, None, None], config)
    for split in range(3):
        assert_same_blend(mine[split], theirs[split])
        assert mine[split].size is None and mine[split].weights == [len(d) for d in mine[split].datasets]
    for a, b in zip(ours([5, 10_000, 0], config), megatrons([5, 10_000, 0], config), strict=True):
        assert_same_blend(a, b)  # capped at the sources' lengths, and an empty split of size 0


def test_blend_index_python_port_equals_megatron_kernel() -> None:
    if helpers_cpp is None:
        pytest.skip(HELPERS_REASON or "")
    rng = np.random.default_rng(0)
    for trial in range(40):
        k = int(rng.integers(1, 6))
        cases = [(normalize(rng.random(k)), int(rng.integers(0, 400))), (normalize([1] * k), 61),
                 (rng.integers(1, 40, k).tolist(), None)]  # weighted, all-tied, exhaustive
        for weights, size in cases:
            a = build_blend_index(weights, size)
            b = build_blend_index(weights, size, kernels=helpers_cpp)
            assert np.array_equal(a.dataset_index, b.dataset_index), (trial, weights, size)
            assert np.array_equal(a.dataset_sample_index, b.dataset_sample_index)


class _ArrayDataset(MegatronDataset):
    """A non-GPT MegatronDataset over a .npy array (as upstream's TestDataset): must be delegated."""

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config) -> None:  # noqa: ANN001
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.sample_index = self.indices if num_samples is None else np.resize(self.indices, num_samples)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: np.ndarray) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> np.ndarray:
        return np.load(dataset_path)

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return {"text": self.dataset[self.sample_index[idx]]}


def test_other_dataset_classes_are_delegated_to_megatron(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    paths = []
    for i in range(2):
        paths.append(os.path.join(str(tmp_path), f"{i}.npy"))
        np.save(paths[-1], np.arange(10 * (i + 1) * SEQ).reshape(-1, SEQ))
    config = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=SEQ,
                                          blend_per_split=[(paths, None), None, None])
    with caplog.at_level(logging.WARNING, logger="megascale_data_ext.megatron.builder"):
        builder = MegascaleDatasetBuilder(_ArrayDataset, [None, None, None], lambda: True, config)
    assert isinstance(builder.delegate, BlendedMegatronDatasetBuilder)
    assert "_ArrayDataset is delegated to Megatron's BlendedMegatronDatasetBuilder" in caplog.text
    train, valid, test = builder.build()
    assert isinstance(train, BlendedDataset) and len(train) == 30 and valid is None and test is None
    weighted = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=SEQ,
                                            blend_per_split=[(paths, [1.0, 2.0]), None, None])
    with pytest.raises(AssertionError):  # Megatron's own refusal, raised by Megatron's builder
        MegascaleDatasetBuilder(_ArrayDataset, [None, None, None], lambda: True, weighted)


def _refusals(prefixes: list[str]) -> list[tuple[str, list, GPTDatasetConfig, type]]:
    return [
        ("weighted without size", [None, 5, 5], make_config(blend=(prefixes[:2], [0.5, 0.5]), split="90,8,2"),
         GPTDataset),
        ("weighted single prefix without size", [10, 5, None],
         make_config(blend_per_split=[None, None, ([prefixes[0]], [1.0])]), GPTDataset),
        ("zero weight", [100, 5, 5], make_config(blend=(prefixes[:3], [0.5, 0.0, 0.5]), split="90,8,2"), GPTDataset),
        ("negative weight", [100, 5, 5], make_config(blend_per_split=[(prefixes[:2], [1.0, -1.0]), None, None]),
         GPTDataset),
        ("mock class with a blend", [5, 5, 5], make_config(blend=([prefixes[0]], None), split="90,8,2"),
         MockGPTDataset),
    ]


@needs_megatron_helpers
@pytest.mark.parametrize("case", range(5))
def test_refuses_what_megatron_refuses(prefixes: list[str], case: int) -> None:
    name, sizes, config, cls = _refusals(prefixes)[case]
    with pytest.raises(AssertionError):
        megatrons(sizes, config, cls)
    with pytest.raises(BuilderArgumentError) as info:  # at construction, before any index is built
        MegascaleDatasetBuilder(cls, sizes, lambda: True, config)
    assert isinstance(info.value, AssertionError) and isinstance(info.value, ConfigError), name
    assert "split" in str(info.value) or "mock" in str(info.value), name


@needs_megatron_helpers
def test_unweighted_blend_with_an_empty_source_split_is_refused_like_megatron(prefixes: list[str]) -> None:
    config = make_config(blend=(prefixes[:2], None), split="969,30,1")  # 40 docs: the test split is empty
    import megatron.core

    if tuple(int(x) for x in megatron.core.__version__.split(".")[:2]) < (0, 18):
        with pytest.raises(AssertionError):
            megatrons([None, None, None], config)
    # megatron-core 0.18's C++ build_sample_idx aborts the whole process on it instead: only ours is checked
    with pytest.raises(BuilderArgumentError, match=r"(valid|test) split: \[.*src.*\] hold no 16-token sample"):
        ours([None, None, None], config)


def test_oversampling_names_the_source_and_the_surplus_key(prefixes: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's IndexError when a blend asks a source for more than it built. GPT sources hold
    whole epochs, so a real blend rarely gets there: the index is made to ask for one sample more."""
    import megascale_data_ext.megatron.builder as builder_module

    def greedy_plus_one(*args: object, **kwargs: object) -> object:
        index = build_blend_index(*args, **kwargs)
        index.counts[0] = 10**6
        return index

    monkeypatch.setattr(builder_module, "build_blend_index", greedy_plus_one)
    config = make_config(blend=(prefixes[:3], [1, 1, 1]), split="90,8,2", mid_level_dataset_surplus=0.0)
    with pytest.raises(BlendOversampledError, match=r"train blend asks .*src0.* \(source 0\) for 1000000 samples.*"
                                                    r"`mid_level_dataset_surplus` \(now 0.0\)") as info:
        ours([7, 2, 1], config)
    assert isinstance(info.value, IndexError)


@needs_megatron_helpers
def test_none_on_ranks_that_do_not_build_under_a_process_group(prefixes: list[str], tmp_path: object) -> None:
    config = make_config(blend=(prefixes[:3], [0.2, 0.3, 0.5]), split="90,8,2")
    assert [len(d) for d in MegascaleDatasetBuilder(GPTDataset, [100, 7, 5], lambda: False, config).build()] == [
        len(d) for d in megatrons([100, 7, 5], config)]  # no process group: Megatron builds regardless
    assert not torch.distributed.is_initialized()
    store = torch.distributed.FileStore(os.path.join(str(tmp_path), "store"), 1)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=store, timeout=timedelta(seconds=60))
    try:
        assert MegascaleDatasetBuilder(GPTDataset, [100, 7, 5], lambda: False, config).build() == [None] * 3
        assert BlendedMegatronDatasetBuilder(GPTDataset, [100, 7, 5], lambda: False, config).build() == [None] * 3
    finally:
        torch.distributed.destroy_process_group()


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
    with pytest.raises(BuilderArgumentError, match=r"train split: weighted blends need a size.*sizes\[0\]=None"):
        MegascaleDatasetBuilder(GPTDataset, [None, 5, 5], lambda: True, weighted)
    with pytest.raises(BuilderArgumentError, match="`sizes` must be 3"):
        MegascaleDatasetBuilder(GPTDataset, [5, 5], lambda: True, weighted)
    with pytest.raises(BuilderArgumentError, match=r"positive and finite, got \[0.0, 1.0\].*weight 0.0"):
        MegascaleDatasetBuilder(GPTDataset, [5, 5, 5], lambda: True, make_config(blend=(prefixes[:2], [0.0, 1.0]),
                                                                                   split="90,8,2"))
    tiny = make_config(blend=([prefixes[0]], None), split="969,30,1")  # 40 docs: the test split is empty
    with pytest.raises(SourceError, match="src0.*0 documents.*split"):
        ours([10, 10, 10], tiny)  # Megatron loops forever here
    assert len(ours([10, 10, None], tiny)[2]) == 0  # a full epoch of nothing is fine
    missing = make_config(blend=([str(tmp_path) + "/nope"], None), split="90,8,2")
    with pytest.raises(SourceError, match="nope"):
        ours([1, 1, 1], missing)
