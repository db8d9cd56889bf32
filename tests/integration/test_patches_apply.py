"""patches/pretrain_gpt*.patch: their shape, and that each applies to the Megatron-LM files it is for.

`pretrain_gpt.patch` is for core_v0.16.1 (and 0.17.1, whose `__main__` block is the same);
`pretrain_gpt_core_v0.19.patch` for core_v0.19.0 and core_v0.18.2 (`setattr(..., "is_distributed",
True)`, `pretrain(full_config, ...)`). The upstream files are not vendored. Point MEGATRON_LM_DIR at
a Megatron-LM clone (work tree or bare git dir holding the tags), or fetch one under /work/.mirror/;
without either, the tests that need a file skip and say so. The recorded hashes below pin the exact
files the patches were written against, so a clone at another ref is reported, not silently patched.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "pretrain_gpt.patch"
PATCH_V19 = ROOT / "patches" / "pretrain_gpt_core_v0.19.patch"
UPSTREAM_REF = "core_v0.16.1"
UPSTREAM_FILE = "pretrain_gpt.py"
UPSTREAM_SHA256 = "5a5b8fe909610892146e4d2ef5b303bd9b73bb31dfc96d73f2d0afb8937d4b22"
UPSTREAM_SIZE = 13504  # bytes
UPSTREAM_LINES = 351
UPSTREAM_BLOB = "8eff08d24b20655bb640eb8d2f08f9303ef78495"  # git blob id (the patch's `index` line)


@dataclass(frozen=True)
class Upstream:
    """One Megatron-LM file a patch is for: its tag, its pinned content, and where the switch must sit."""

    patch: Path
    ref: str
    sha256: str
    size: int
    lines: int
    blob: str
    after: str  # upstream's own provider setup, before the switch
    before: str  # pretrain() taking the provider, after the switch


UPSTREAMS = (
    Upstream(PATCH, UPSTREAM_REF, UPSTREAM_SHA256, UPSTREAM_SIZE, UPSTREAM_LINES, UPSTREAM_BLOB,
             "train_valid_test_datasets_provider.is_distributed = True",
             "    pretrain(\n        train_valid_test_datasets_provider,"),
    Upstream(PATCH_V19, "core_v0.19.0", "7283c4aeb5a00c694bbf2930527a184fc0d5f607f548c74707c71cc240d05fae", 19976,
             530, "47c1935eb90ccac190b8c2934193e0d91bf99199",
             'setattr(train_valid_test_datasets_provider, "is_distributed", True)',
             "    pretrain(\n        full_config,\n        train_valid_test_datasets_provider,"),
    Upstream(PATCH_V19, "core_v0.18.2", "c80438d4bf7c842ff6ebe06c1f9d796045f350add57adc015eda6be2016e6036", 16518,
             407, "8fc21ed4c0ce3a8bb31b0012216d9b23c0cd39a8",
             'setattr(train_valid_test_datasets_provider, "is_distributed", True)',
             "    pretrain(full_config,\n        train_valid_test_datasets_provider,"),
)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, timeout=60)


def upstream_source(ref: str = UPSTREAM_REF) -> tuple[bytes, str] | None:
    """(content, where) of pretrain_gpt.py at `ref`, or None when no clone is around."""
    candidates = [os.environ["MEGATRON_LM_DIR"]] if os.environ.get("MEGATRON_LM_DIR") else []
    mirrors = "/work/.mirror/*Megatron-LM*"
    candidates += sorted(glob.glob(f"{mirrors}/repo")) + sorted(glob.glob(mirrors))
    for cand in candidates:
        if shutil.which("git"):
            for flag in ("--git-dir", "-C"):
                res = _git(flag, cand, "show", f"{ref}:{UPSTREAM_FILE}")
                if res.returncode == 0:
                    return res.stdout, f"{cand} @ {ref}"
        work_tree = Path(cand) / UPSTREAM_FILE
        if work_tree.is_file():  # a plain checkout without the tag: its hash must still match
            return work_tree.read_bytes(), str(work_tree)
    return None


@pytest.fixture(scope="module", params=UPSTREAMS, ids=lambda u: u.ref)
def upstream(request: pytest.FixtureRequest) -> tuple[bytes, str, Upstream]:
    u = request.param
    found = upstream_source(u.ref)
    if found is None:
        pytest.skip(f"no Megatron-LM clone: set MEGATRON_LM_DIR to a clone with tag {u.ref} "
                    "(or fetch github:NVIDIA/Megatron-LM into /work/.mirror/) to check the patch applies")
    return (*found, u)


def hunks(text: str) -> list[list[str]]:
    out: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("@@"):
            out.append([])
        elif out:
            out[-1].append(line)
    return out


# --------------------------------------------------------------- no upstream file needed
@pytest.mark.parametrize("u", UPSTREAMS[:2], ids=lambda u: u.patch.name)
def test_patch_is_small_additive_and_pins_the_upstream_blob(u: Upstream) -> None:
    text = u.patch.read_text()
    files = re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, flags=re.M)
    assert files == [(UPSTREAM_FILE, UPSTREAM_FILE)]
    index = re.search(r"^index ([0-9a-f]+)\.\.", text, flags=re.M)
    assert index is not None and u.blob.startswith(index.group(1))
    body = [line for h in hunks(text) for line in h]
    added = [line[1:] for line in body if line.startswith("+")]
    assert [line for line in body if line.startswith("-")] == []  # default behaviour untouched
    assert len(added) <= 6 and sum(line.startswith(" ") for line in body) <= 6  # context only, no Megatron code
    assert any('os.environ.get("MEGASCALE_DATA", "0") == "1"' in line for line in added)
    assert any("from megascale_data_ext.megatron.provider import train_valid_test_datasets_provider" in line
               for line in added)


def test_patched_import_resolves_to_a_distributed_provider() -> None:
    from megascale_data_ext.megatron.provider import train_valid_test_datasets_provider

    assert train_valid_test_datasets_provider.is_distributed is True
    assert list(inspect.signature(train_valid_test_datasets_provider).parameters) == [
        "train_val_test_num_samples", "vp_stage"]  # Megatron asserts vp_stage is a kwarg under VPP


# --------------------------------------------------------------- needs the upstream file
def test_upstream_file_is_the_one_the_patch_was_written_for(upstream: tuple[bytes, str, Upstream]) -> None:
    content, where, u = upstream
    digest = hashlib.sha256(content).hexdigest()
    assert (digest, len(content)) == (u.sha256, u.size), (
        f"{where} is not Megatron-LM {u.ref}'s {UPSTREAM_FILE} (sha256 {digest}, {len(content)} bytes); "
        f"check out that tag or regenerate patches/{u.patch.name} against the new file")
    blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    assert blob == u.blob and content.count(b"\n") == u.lines


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_patch_applies_and_keeps_the_script_valid(upstream: tuple[bytes, str, Upstream], tmp_path: Path) -> None:
    content, _, u = upstream
    target = tmp_path / UPSTREAM_FILE
    target.write_bytes(content)
    check = subprocess.run(["git", "apply", "--check", "-v", str(u.patch)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    subprocess.run(["git", "apply", str(u.patch)], cwd=tmp_path, check=True, timeout=60)
    patched = target.read_text()
    compile(patched, str(target), "exec")
    # The switch sits after upstream's own provider setup and before pretrain() uses the name.
    at_switch = patched.index('os.environ.get("MEGASCALE_DATA"')
    assert patched.index(u.after) < at_switch
    assert at_switch < patched.index(u.before)
    reverse = subprocess.run(["git", "apply", "--check", "--reverse", str(u.patch)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert reverse.returncode == 0, reverse.stderr
