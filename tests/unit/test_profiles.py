"""Source profiles: the journal (save, merge, reuse, stale entries) and `megascale-data profile` on a tiny config."""

from __future__ import annotations

import json
import os

import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile, fingerprint_of
from megascale_data_ext.errors import ConfigError


def _prof(name: str, fp: str = "a", latency: float = 1e-3) -> SourceProfile:
    return SourceProfile(name=name, fingerprint=fp, num_samples=10, samples_profiled=4, latency_s=latency,
                         access_state_bytes=1000, bytes_per_sample=100, throughput=1 / latency)


def test_journal_round_trip_merge_and_stale(tmp_path) -> None:
    path = tmp_path / "p" / "profiles.json"
    j = ProfileJournal([_prof("a"), _prof("b")])
    j.save(path)
    back = ProfileJournal.load(path)
    assert back.profiles == j.profiles
    back.merge([_prof("b", fp="new", latency=2e-3), _prof("c")])
    assert back.lookup("b", "new").latency_s == 2e-3 and back.lookup("b", "a") is None
    assert back.stale({"a": "a", "b": "changed", "zzz": "x"}) == ["b"]
    assert _prof("a").memory_bytes(3) == 1300
    with pytest.raises(ConfigError, match=r"no profile for sources \['d'\].*megascale-data profile"):
        back.require(["a", "d"])
    path.write_text(json.dumps({"version": 99, "profiles": {}}))
    with pytest.raises(ConfigError, match="version 99.*delete it"):
        ProfileJournal.load(path)
    with pytest.raises(ConfigError, match="'x'.*>= 0.*latency_s=-1"):
        SourceProfile(name="x", fingerprint="f", num_samples=1, samples_profiled=1, latency_s=-1,
                      access_state_bytes=0, bytes_per_sample=0, throughput=0)


def test_fingerprint_follows_files_and_settings(tmp_path) -> None:
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "x"}\n')
    fp = fingerprint_of({"name": "a"}, [str(f)])
    assert fingerprint_of({"name": "a"}, [str(f)]) == fp
    assert fingerprint_of({"name": "a", "truncate": True}, [str(f)]) != fp
    f.write_text('{"text": "xy"}\n')
    os.utime(f, ns=(1, 1))
    assert fingerprint_of({"name": "a"}, [str(f)]) != fp


def test_profile_command_measures_journals_and_reuses(tmp_path, capsys) -> None:
    texts = [f"sample {i} " * (i % 7 + 1) for i in range(40)]
    for name in ("web", "code"):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"data_root: {tmp_path}\nsources:\n  - {{name: web, format: jsonl, paths: [web.jsonl]}}\n"
                   f"  - {{name: code, format: jsonl, paths: [code.jsonl]}}\n")
    out = tmp_path / "prof"
    assert main(["profile", str(cfg), "--out", str(out), "--samples", "16", "--batch", "8", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert sorted(first["measured"]) == ["code", "web"]
    by = {p["name"]: p for p in first["profiles"]}
    assert by["web"]["samples_profiled"] == 16 and by["web"]["num_samples"] == 40
    assert by["web"]["latency_s"] > 0 and by["web"]["throughput"] > 0 and by["web"]["bytes_per_sample"] > 0
    assert (out / "profiles.png").stat().st_size > 0
    assert set(ProfileJournal.load(out / "profiles.json").profiles) == {"web", "code"}
    # a second run reuses both; changing one file re-measures that source only
    assert main(["profile", str(cfg), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured"] == []
    (tmp_path / "code.jsonl").write_text(json.dumps({"text": "changed"}) + "\n")
    assert main(["profile", str(cfg), "--out", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["measured"] == ["code"] and again["stale"] == ["code"]
    assert {p["name"]: p["num_samples"] for p in again["profiles"]} == {"web": 40, "code": 1}


def _megatron_specs(tmp_path, n: int, docs: int = 60) -> list:
    import numpy as np

    from megascale_data_ext.sources.base import SourceSpec
    from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

    specs = []
    for i in range(n):
        rng = np.random.default_rng(i)
        prefix = write_indexed_dataset(tmp_path / f"p{i}", (rng.integers(3, 259, int(k)) for k in
                                                             rng.integers(5, 40 * (i + 1), docs)), vocab_size=259)
        specs.append(SourceSpec(name=f"s{i}", format="megatron", paths=[prefix], append_eod=False, eod_token_id=1))
    return specs


def test_profile_sources_extends_a_kind_from_its_measured_sources(tmp_path, monkeypatch) -> None:
    import gc

    from megascale_data_ext.sources import profiling

    specs = _megatron_specs(tmp_path, 5)
    collections, saves, lines = [], [], []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    save = ProfileJournal.save
    monkeypatch.setattr(ProfileJournal, "save", lambda self, path: saves.append(path) or save(self, path))
    journal = tmp_path / "profiles.json"
    profiles, profiled, stale = profiling.profile_sources(specs, journal, samples=8, batch=4, measure_per_kind=2,
                                                          progress=lines.append, progress_every_s=3600)
    assert profiled == [s.name for s in specs] and stale == [] and collections == [] and saves == [journal]
    measured = [p for p in profiles if p.samples_profiled > 0]
    extended = [p for p in profiles if p.samples_profiled == 0]
    assert len(measured) == 2 and len(extended) == 3
    assert all(p.num_samples == 60 and p.access_state_bytes > 0 and p.latency_s > 0 for p in profiles)
    # bytes per sample follow each source's own token counts (its documents are longer with i)
    by = {p.name: p for p in profiles}
    assert by["s0"].bytes_per_sample < by["s2"].bytes_per_sample < by["s4"].bytes_per_sample
    assert lines[-1].startswith("profiling 5/5 sources (2 measured, 3 from their metadata")
    assert len(lines) == 1  # throttled: the last line only
    assert set(ProfileJournal.load(journal).profiles) == {s.name for s in specs}


def test_profile_sources_measure_all_matches_profile_source(tmp_path) -> None:
    from megascale_data_ext.sources.profiling import profile_source, profile_sources

    specs = _megatron_specs(tmp_path, 2)
    profiles, _, _ = profile_sources(specs, None, samples=8, batch=4)
    assert all(p.samples_profiled == 8 for p in profiles)
    one = profile_source(specs[1], samples=8, batch=4)
    assert one.num_samples == profiles[1].num_samples and one.bytes_per_sample == profiles[1].bytes_per_sample
    assert abs(one.access_state_bytes - profiles[1].access_state_bytes) < 0.2 * one.access_state_bytes


def test_extended_megatron_sources_are_profiled_from_their_index_files_alone(tmp_path, monkeypatch) -> None:
    # Issue 25: opening every extended source (its .bin mapped, under tracemalloc) was 0.4 s of a
    # 1,024-prefix start. Their profiles now come from the .idx arrays: the same document count
    # and token counts as opening gives, the memory from a measured kind-mate's bytes per document.
    from megascale_data_ext.sources import profiling
    from megascale_data_ext.sources.megatron_indexed import MegatronIndexedSource, peek_document_lengths
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    specs = _megatron_specs(tmp_path, 6)
    for spec in specs:
        assert (peek_document_lengths(list(spec.paths)) == MegatronIndexedSource(spec).document_lengths).all()
    opened_names = []
    measure_held = profiling._measure_held
    monkeypatch.setattr(profiling, "_measure_held", lambda spec, *a: opened_names.append(spec.name) or
                        measure_held(spec, *a))
    profiles, _, _ = profiling.profile_sources(specs, None, samples=8, batch=4, measure_per_kind=2)
    measured = [p.name for p in profiles if p.samples_profiled > 0]
    assert len(measured) == 2 and opened_names == measured  # the other 4 were not opened
    monkeypatch.setattr(profiling, "_measure_held", measure_held)

    tokenizer = load_tokenizer(specs[0])
    with profiling._tracing():
        ref = measure_held(specs[0], [], tokenizer)
        opened = [measure_held(s, [], tokenizer) for s in specs[1:]]
    rates = profiling._KindRates(latency_s=1e-5, overhead_s=1e-5, bytes_per_token=None, bytes_per_sample=1.0,
                                 read_state=0.0, opened_per_sample=ref.opened / ref.num_samples)
    for spec, held in zip(specs[1:], opened, strict=True):
        peeked = profiling._peeked(spec, tokenizer, rates)
        assert (peeked.num_samples, peeked.mean_tokens) == (held.num_samples, held.mean_tokens)
        assert 0.5 * held.opened <= peeked.opened <= 2 * held.opened  # an estimate, of the right size


def test_a_damaged_index_is_not_peeked_but_opened_and_named(tmp_path) -> None:
    from megascale_data_ext.errors import SourceError
    from megascale_data_ext.sources import profiling
    from megascale_data_ext.sources.megatron_indexed import peek_document_lengths

    specs = _megatron_specs(tmp_path, 4)
    idx = specs[3].paths[0] + ".idx"
    with open(idx, "r+b") as f:
        f.write(b"NOTANIDX!")
    assert peek_document_lengths(list(specs[3].paths)) is None
    assert peek_document_lengths([str(tmp_path / "missing")]) is None
    os.remove(specs[1].paths[0] + ".bin")
    assert peek_document_lengths(list(specs[1].paths)) is None
    with pytest.raises(SourceError, match="s3"):
        profiling.profile_sources(specs[2:], None, samples=8, batch=4, measure_per_kind=1)
    with pytest.raises(SourceError, match="s1.*missing"):
        profiling.profile_sources([specs[0], specs[1]], None, samples=8, batch=4, measure_per_kind=1)
