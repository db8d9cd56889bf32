"""`megascale-data serve` before Ray starts: layout flags, refusals, what the ranks are told."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.commands import serve
from megascale_data_ext.commands._config_args import layout_sizes
from megascale_data_ext.dataplane.placetree import ClientPlaceTree


def test_bad_layout_is_one_error_line_before_ray(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--world-size", "3", "--tp", "2", "--pp", "1", "data.seq_length=512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot serve this layout: world size 3 is not divisible")


def test_overrides_after_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    # the typo'd key after the flags is composed and rejected by name (no argparse "unrecognized")
    assert main(["serve", "--world-size", "2", "--tp", "1", "--pp", "1", "data.seq_lenght=512"]) == 2
    assert "seq_lenght" in capsys.readouterr().err


def test_feedback_mixing_is_refused_since_pretrain_gpt_reports_no_loss(tmp_path, capsys) -> None:
    """Before the sources are checked (here they do not exist): with serve they could never be used."""
    assert main(["serve", "--world-size", "2", "--tp", "1", "--pp", "1", f"data.data_root={tmp_path}",
                 "data.mixing.type=feedback", "+data.mixing.params.base_weights=[1,1,1,1]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`data.mixing.type` feedback needs each step's per-source loss" in err[0]
    assert "data.mixing.type=constant" in err[0]


def test_stray_flags_are_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--world-size", "2", "--nonsense"])
    assert "unrecognized arguments: --nonsense" in capsys.readouterr().err


def test_layout_flags_override_the_config_parallel_node() -> None:
    cfg = {"parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}
    args = SimpleNamespace(tp=None, pp=1, cp=None, vpp=None)
    assert layout_sizes(cfg, args) == {"tp": 2, "pp": 1, "cp": 1, "vpp": None}
    assert layout_sizes({}, args) == {"tp": 1, "pp": 1, "cp": 1, "vpp": None}


def test_ranks_are_told_env_and_matching_megatron_flags() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, pp=1, world_size=8)
    handles = SimpleNamespace(address="10.0.0.1:6379", namespace="ns", ray_env={"RAY_AUTH_MODE": "token"})
    env = serve.connect_env(handles, num_microbatches=4)
    assert env == {"MEGASCALE_DATA": "1", "MEGASCALE_RAY_ADDRESS": "10.0.0.1:6379", "MEGASCALE_NAMESPACE": "ns",
                   "MEGASCALE_NUM_MICROBATCHES": "4", "RAY_AUTH_MODE": "token"}
    flags = serve.megatron_flags(tree, SimpleNamespace(num_microbatches=4, seq_length=2048))
    got = dict(zip(flags[::2], flags[1::2], strict=True))
    # Megatron: num_microbatches = global batch / (micro batch * DP) = 16 / (1 * 4) = the service's 4
    assert got["--global-batch-size"] == "16" and got["--micro-batch-size"] == "1"
    assert got["--dataloader-type"] == "external" and got["--tensor-model-parallel-size"] == "2"
    assert got["--seq-length"] == "2048"


def test_a_stop_signal_during_a_status_line_is_not_swallowed() -> None:
    """SIGTERM landing while `serve` prints a status line (inside its ``except Exception``) stops it:
    the stop is no Exception, and the handler has already set further signals to be ignored."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve._catch_signals()
        with pytest.raises(serve._Stop, match="SIGTERM"):
            try:  # the serving loop's guard around a status line
                signal.raise_signal(signal.SIGTERM)
            except Exception:  # noqa: BLE001 - what the loop catches
                pytest.fail("the stop was swallowed as an Exception")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_an_env_file_that_cannot_be_written_is_refused_before_the_service_starts(tmp_path):
    from megascale_data_ext.commands.serve import check_env_file
    from megascale_data_ext.errors import ConfigError

    check_env_file(None)
    check_env_file(tmp_path / "serve.env")  # a new file in a writable directory
    with pytest.raises(ConfigError, match=r"--env-file '.*gone/serve.env': its directory '.*gone' does not exist"):
        check_env_file(tmp_path / "gone" / "serve.env")
    with pytest.raises(ConfigError, match=r"it is a directory; name a file"):
        check_env_file(tmp_path)


def test_an_output_path_under_a_file_is_refused_before_the_command_works(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    bad = str(tmp_path / "notes.txt" / "out.json")
    assert main(["lint", str(tmp_path / "nothing-needed"), "--json", bad]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --json {bad!r}: {str(tmp_path / 'notes.txt')!r} is a file, not "
                                               "a directory; name a path inside a directory")
    from megascale_data_ext.cli import output_path_problem

    assert output_path_problem(SimpleNamespace(json=str(tmp_path / "new" / "dir" / "r.json"), plot=True)) is None
