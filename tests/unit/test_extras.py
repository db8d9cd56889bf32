"""Optional extras (pyproject `plot`, `sentencepiece`): without them, one error line that says
what to install, before any work starts."""

from __future__ import annotations

import sys

import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.errors import ConfigError


def test_a_plot_without_matplotlib_is_refused_before_the_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    ran = []
    monkeypatch.setattr("megascale_data_ext.commands.bench_balance.run", lambda args: ran.append(args) or 0)
    for argv in (["bench", "balance", "--plot", str(tmp_path / "f.png")], ["heatmap", "sources=demo_text", "--out", str(tmp_path / "h.png")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install 'megascale_data_ext[plot]'" in err[0], err
    assert ran == []


def test_a_sentencepiece_model_without_sentencepiece_names_the_key_and_the_extra(monkeypatch, tmp_path):
    from megascale_data_ext.sources.tokenizer import SentencePieceTokenizer

    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ConfigError, match=r"`sources\.web\.tokenizer`: .*megascale_data_ext\[sentencepiece\]"):
        SentencePieceTokenizer(tmp_path / "tok.model", key="sources.web.tokenizer")
