"""Tokenizers as Megatron users name them, built from tiny files trained on the fly (no network)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.sources import SourceSpec, open_source
from megascale_data_ext.sources.parquet import KV_TOKENIZER
from megascale_data_ext.sources.tokenizer import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    tokenizer_types,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello tokenizers!",
    "Ünïcode text — with dashes and 数字 123.",
] * 20
TEXT = "Hello world, the fox 数字"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A byte-level BPE saved both as tokenizer.json and as GPT-2 vocab/merges, and a SentencePiece model."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    tok.model.save(str(d), "gpt2")  # gpt2-vocab.json + gpt2-merges.txt, Megatron's file names
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=60,
                                   model_type="bpe", character_coverage=1.0, user_defined_symbols=["<image>"],
                                   minloglevel=2)
    (d / "sp.model").write_bytes(model.getvalue())
    return d


def test_each_type_round_trips_and_counts_what_it_encodes(files):
    import sentencepiece as spm

    hf = load_tokenizer(files / "tokenizer.json")
    gpt2 = load_tokenizer(files / "gpt2-vocab.json")  # merges found beside it, as Megatron names them
    sp = load_tokenizer(files / "sp.model")
    assert (type(hf), type(gpt2), type(sp)) == (HFTokenizer, GPT2BPETokenizer, SentencePieceTokenizer)
    for tok in (hf, gpt2, sp, ByteTokenizer()):
        ids = tok.encode(TEXT)
        assert tok.decode(ids) == TEXT
        assert tok.count([TEXT, "", "fox"]).tolist() == [len(ids), 0, len(tok.encode("fox"))]
    # The GPT-2 files reload into the very tokenizer that was trained: same ids, same EOD/PAD.
    assert gpt2.encode(TEXT).tolist() == hf.encode(TEXT).tolist()
    assert (gpt2.eod_id, gpt2.pad_id) == (hf.eod_id, hf.pad_id) == (0, 1)
    assert gpt2.fingerprint() != hf.fingerprint()
    ref = spm.SentencePieceProcessor(model_file=str(files / "sp.model"))
    assert sp.encode(TEXT).tolist() == ref.encode_as_ids(TEXT)  # what Megatron's SentencePieceTokenizer gives
    assert (sp.eod_id, sp.pad_id, sp.image_id, sp.vocab_size) == (ref.eos_id(), ref.eos_id(),
                                                                  ref.piece_to_id("<image>"), 60)


def test_gpt2_bpe_applies_the_merges_file(tmp_path):
    vocab = {"h": 0, "e": 1, "l": 2, "o": 3, "he": 4, "ll": 5, "hell": 6, "hello": 7, "Ġ": 8, "<|endoftext|>": 9}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\nl l\nhe ll\nhell o\n")
    tok = load_tokenizer(tmp_path, tokenizer_type="GPT2BPETokenizer")  # a directory holding both files
    assert tok.encode("hello hello").tolist() == [7, 8, 7] and tok.eod_id == 9
    (tmp_path / "half.txt").write_text("#version: 0.2\nh e\n")
    tok = load_tokenizer(tmp_path / "vocab.json", tokenizer_type="GPT2BPETokenizer", merge_file="half.txt")
    assert tok.encode("hello").tolist() == [4, 2, 2, 3]  # only `h e` merged: the merge file given was used


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"tokenizer": "tokenizer.json", "tokenizer_type": "GPT2Tokenizer"},
         "`data.sources.s.tokenizer_type` must be one of ['ByteTokenizer', 'GPT2BPETokenizer', 'HuggingFaceTokenizer', "
         "'SentencePieceTokenizer'] (Megatron's --tokenizer-type names) or null, got 'GPT2Tokenizer'"),
        ({"tokenizer": "nope.json"}, "`data.sources.s.tokenizer`: tokenizer file '{d}/nope.json' not found"),
        ({"tokenizer": "nope.model"}, "`data.sources.s.tokenizer`: SentencePiece model '{d}/nope.model' not found"),
        ({"tokenizer": "gpt2-vocab.json", "merge_file": "other-merges.txt"},
         "GPT2BPETokenizer merge file (merges.txt) '{d}/other-merges.txt' not found; give the vocab.json path in "
         "`tokenizer` and the merges.txt path in `merge_file`"),
        ({"tokenizer_type": "SentencePieceTokenizer"},
         "`data.sources.s.tokenizer_type` is SentencePieceTokenizer but `data.sources.s.tokenizer` is not set"),
        ({"tokenizer": "sp.model", "tokenizer_type": "ByteTokenizer"},
         "`data.sources.s.tokenizer_type` is ByteTokenizer, which reads no file; drop one of them"),
        ({"tokenizer": "tokenizer.json", "tokenizer_type": "SentencePieceTokenizer"},
         "`data.sources.s.tokenizer`: cannot load '{d}/tokenizer.json' as a SentencePiece model"),
        ({"tokenizer": "sp.model", "tokenizer_type": "HuggingFaceTokenizer"},
         "`data.sources.s.tokenizer`: cannot load '{d}/sp.model' as a Hugging Face tokenizer.json"),
    ],
)
def test_errors_name_the_key_and_the_path(files, kwargs, expected):
    kwargs = {k: (str(files / v) if k == "tokenizer" else v) for k, v in kwargs.items()}
    (files / "data.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError) as err:
        open_source(SourceSpec(name="s", format="jsonl", paths=[str(files / "data.jsonl")], **kwargs))
    assert expected.format(d=files) in str(err.value)


def test_tokenizer_without_eod_is_refused(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ConfigError, match=r"`--tokenizer`: tokenizer '.*vocab.json' \+ '.*merges.txt' has none of "
                                          r"the EOD tokens \['<\|endoftext\|>'\]"):
        load_tokenizer(tmp_path / "vocab.json", key="--tokenizer")


def test_sources_and_prepare_use_the_configured_tokenizer(files, tmp_path, capsys):
    """A JSONL source reads with the SentencePiece model; prepare writes GPT-2 BPE costs a Parquet source trusts."""
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:3]))
    spec = SourceSpec(name="sp", format="jsonl", paths=[str(tmp_path / "d.jsonl")], tokenizer=str(files / "sp.model"),
                      tokenizer_type="SentencePieceTokenizer")
    with open_source(spec) as src:
        samples = src.read(np.arange(3))
        assert [len(s.tokens) for s in samples] == src.metadata()["text_tokens"].tolist()
        assert src.tokenizer.decode(samples[1].tokens[:-1]) == CORPUS[1] and samples[1].tokens[-1] == 2  # EOS

    out = tmp_path / "out"
    rc = main(["prepare", "--input", str(tmp_path / "d.jsonl"), "--output", str(out), "--no-progress",
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(files / "gpt2-vocab.json"),
               "--merge-file", str(files / "gpt2-merges.txt")])
    assert rc == 0, capsys.readouterr().err
    (shard,) = sorted(out.glob("*.parquet"))
    gpt2 = load_tokenizer(files / "gpt2-vocab.json")
    assert pq.ParquetFile(shard).schema_arrow.metadata[KV_TOKENIZER.encode()] == gpt2.fingerprint().encode()
    assert pq.read_table(shard)["num_tokens"].to_pylist() == [len(gpt2.encode(t)) + 1 for t in CORPUS[:3]]
    pspec = SourceSpec(name="p", format="parquet", paths=[str(out)], tokenizer=str(files / "gpt2-vocab.json"),
                       tokenizer_type="GPT2BPETokenizer", merge_file="gpt2-merges.txt")
    with open_source(pspec) as src:
        assert [len(s.tokens) for s in src.read([0, 1, 2])] == src.metadata()["text_tokens"].tolist()

    assert main(["prepare", "--input", str(tmp_path / "d.jsonl"), "--output", str(out),
                 "--tokenizer-type", "SentencePieceTokenizer"]) == 2
    assert "`--tokenizer-type` is SentencePieceTokenizer but `--tokenizer` is not set" in capsys.readouterr().err


def test_config_schema_has_the_tokenizer_keys():
    from megascale_data_ext.config.schema import SourceConfig

    names = {f for f in SourceConfig.__dataclass_fields__}
    assert {"tokenizer", "tokenizer_type", "merge_file", "on_bad_rows"} <= names
    assert "HuggingFaceTokenizer" in tokenizer_types()


def test_data_config_takes_megatron_tokenizer_keys_and_names_bad_ones(files, tmp_path):
    from megascale_data_ext.config import load_config

    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    source = {"name": "web", "format": "jsonl", "path": "d.jsonl", "tokenizer": str(files / "sp.model"),
              "tokenizer_type": "SentencePieceTokenizer"}
    cfg = {"data_root": str(tmp_path), "seq_length": 64, "sources": [source]}
    (spec,) = load_config(cfg).source_specs()
    assert isinstance(open_source(spec).tokenizer, SentencePieceTokenizer)
    with pytest.raises(ConfigError) as err:
        load_config({**cfg, "sources": [{**source, "tokenizer_type": "Llama", "on_bad_rows": "drop"}]})
    assert "`data.sources[0].tokenizer_type`: must be one of ['ByteTokenizer', " in str(err.value)
    assert "`data.sources[0].on_bad_rows`: must be one of ['error', 'skip'], got 'drop'" in str(err.value)


def test_the_data_config_loads_the_tokenizer_so_a_wrong_file_or_type_is_a_startup_error(files, tmp_path):
    from megascale_data_ext.config import load_config

    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_bytes((files / "tokenizer.json").read_bytes())
    source = {"name": "web", "format": "jsonl", "path": "d.jsonl", "tokenizer": str(tmp_path / "hf")}
    cfg = {"data_root": str(tmp_path), "seq_length": 64, "sources": [source]}
    load_config(cfg)  # a directory holding tokenizer.json is a tokenizer
    wrong = {**source, "tokenizer": str(files / "tokenizer.json"), "tokenizer_type": "SentencePieceTokenizer"}
    with pytest.raises(ConfigError) as err:
        load_config({**cfg, "sources": [wrong]})
    assert "`data.sources[0].tokenizer`: " in str(err.value) and "tokenizer.json" in str(err.value)
