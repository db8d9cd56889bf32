"""The wheel ships the Hydra config groups and the plugin that puts them on every app's search path, and an
installed wheel composes configs from them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_conf_and_composes_from_it(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "conf", src / "conf")
    shutil.copytree(REPO / "megascale_data_ext", src / "megascale_data_ext", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "hydra_plugins", src / "hydra_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    assert (src / "megascale_data_ext" / "conf").is_symlink()  # the repository layout, link included
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("megascale_data_ext-*.whl")

    expected = {p.relative_to(REPO / "conf").as_posix(): p.read_bytes() for p in (REPO / "conf").rglob("*")
                if p.suffix in (".yaml", ".py")}  # __init__.py: `pkg://megascale_data_ext/conf` needs a package
    assert {"train_gpt.yaml", "data/megascale.yaml", "strategy/llm_balance.yaml"} <= set(expected)
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n.removeprefix("megascale_data_ext/conf/"): zf.read(n) for n in zf.namelist()
                   if n.startswith("megascale_data_ext/conf/")}
        assert shipped == expected  # every group file, byte for byte, as real files
        names = set(zf.namelist())
        assert "hydra_plugins/megascale_data_ext_searchpath/__init__.py" in names
        assert "hydra_plugins/__init__.py" not in names  # a namespace package: other packages' plugins stay visible
        zf.extractall(tmp_path / "site")  # a pure-Python wheel installs by unpacking

    probe = textwrap.dedent("""
        import megascale_data_ext
        from megascale_data_ext.config import compose_config, conf_dir
        print(megascale_data_ext.__file__)
        print(conf_dir())
        cfg = compose_config(["data.seq_length=64", "strategy=vanilla"])
        print(cfg.data.seq_length, cfg.data.strategy._target_, len(cfg.data.sources))
        import pathlib, tempfile, warnings
        from hydra import compose, initialize_config_dir
        d = tempfile.mkdtemp()  # a user's own configs: one relying on the package's Hydra plugin, one on searchpath
        pathlib.Path(d, "mine.yaml").write_text("defaults:\\n  - data: megascale\\n  - _self_\\n")
        pathlib.Path(d, "mine_searchpath.yaml").write_text(
            "hydra:\\n  searchpath: [pkg://megascale_data_ext/conf]\\ndefaults:\\n  - data: megascale\\n  - _self_\\n")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Hydra warns when a search path source is not available
            with initialize_config_dir(d, version_base=None):
                print(compose("mine").data.seq_length)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with initialize_config_dir(d, version_base=None):
                print(compose("mine_searchpath").data.seq_length,
                      sum("no_such_package_of_configs" in str(w.message) for w in seen))
    """)
    env = {k: v for k, v in os.environ.items() if k != "MEGASCALE_CONF_DIR"}
    # Another package's Hydra plugin whose source is unreachable, as multi-storage-client's (megatron-energon's
    # dependency) is without an MSC profile: Hydra checks every source only when a config sets hydra.searchpath.
    fake = tmp_path / "plugins" / "hydra_plugins" / "unreachable_source"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent("""
        from hydra.plugins.search_path_plugin import SearchPathPlugin
        class UnreachableSourcePlugin(SearchPathPlugin):
            def manipulate_search_path(self, search_path):
                search_path.append("unreachable", "pkg://no_such_package_of_configs/conf")
    """))
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path / "site"), str(tmp_path / "plugins")))
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.splitlines()
    site = tmp_path / "site" / "megascale_data_ext"
    assert out[0] == str(site / "__init__.py")  # the unpacked wheel, not the checkout
    assert out[1] == str(site / "conf") and not (site / "conf").is_symlink()
    assert out[2] == "64 megascale_data_ext.dataplane.strategies.Vanilla 4"  # strategy=vanilla from the wheel
    assert out[3] == "1024"  # the README's adoption: `data: megascale` found through the package's Hydra plugin
    assert out[4] == "1024 1"  # with hydra.searchpath it composes too, but Hydra warns for the unreachable source
