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
