"""`bench soak`'s memory verdict: growth after warm-up, per process, from windows of samples."""

from __future__ import annotations

from megascale_data_ext.commands.bench_soak import CLIENTS, memory_summary, service_flat


def samples(series: dict[str, list[float]]) -> list[dict]:
    n = len(next(iter(series.values())))
    return [{"t": 10.0 * i, "own_mib": {k: v[i] for k, v in series.items()}} for i in range(n)]


def test_warm_up_growth_is_not_counted_but_steady_growth_after_it_is():
    got = memory_summary(samples({
        "constructor/0": [100, 180, 200, 201, 202, 203],  # allocator warm-up, then flat
        "loader/0": [100, 100, 100, 105, 110, 115],  # grows after warm-up: a leak
    }), warm_from=20.0, flat=0.05)
    assert got["constructor/0"]["warm_mib"] == 200 and got["constructor/0"]["flat"]
    assert got["loader/0"]["growth"] == 0.15 and not got["loader/0"]["flat"]
    assert got["constructor/0"]["max_mib"] == 203


def test_a_process_that_appears_late_is_judged_from_its_own_first_warm_sample():
    rows = samples({"planner": [150, 150, 150, 151]})
    rows[3]["own_mib"]["loader/9"] = 90.0  # spawned by the autoscaler at t=30
    got = memory_summary(rows, warm_from=25.0, flat=0.05)
    assert got["loader/9"] == {"warm_mib": 90.0, "end_mib": 90.0, "max_mib": 90.0, "growth": 0.0,
                               "growth_endpoints": 0.0, "flat": True}


def test_a_working_set_that_swings_is_flat_and_a_steady_rise_under_the_swing_is_not():
    """Medians of the first and last fifth judge the level; two single samples judge the swing."""
    swing = [100, 130, 105, 125, 100, 135, 110, 120, 100, 128] * 2
    got = memory_summary(samples({"constructor/0": [100] * 5 + swing + [112]}), warm_from=50.0, flat=0.05)
    assert got["constructor/0"]["growth_endpoints"] == 0.12 and got["constructor/0"]["flat"]
    rising = [v + 2 * i for i, v in enumerate(swing)]  # +2 MiB a sample beneath the same swing
    got = memory_summary(samples({"constructor/0": [100] * 5 + rising}), warm_from=50.0, flat=0.05)
    assert got["constructor/0"]["growth"] > 0.2 and not got["constructor/0"]["flat"]


def test_the_verdict_judges_the_services_actors_and_reports_the_clients_process_beside_them():
    got = memory_summary(samples({"planner": [75] * 10, CLIENTS: [300] * 5 + [330] * 5}), warm_from=0.0, flat=0.05)
    assert not got[CLIENTS]["flat"] and service_flat(got)
    got["loader 0"] = {"flat": False}
    assert not service_flat(got)


def test_object_store_pages_a_process_touched_are_counted_apart_from_its_own_memory(tmp_path):
    """Pages of Ray's object store (a /dev/shm/plasma* mapping) that only this process touched are
    private by the kernel's count; the split keeps them out of the process's own memory."""
    import mmap
    import os
    from pathlib import Path

    import numpy as np
    import pytest

    from megascale_data_ext.commands._proc_stats import OBJECT_STORE_MAPPING, private_split_mib

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    path = f"{OBJECT_STORE_MAPPING}-test-{os.getpid()}"
    size = 64 << 20
    with open(path, "w+b") as f:
        f.truncate(size)
        store = mmap.mmap(f.fileno(), size)
    try:
        before = private_split_mib(os.getpid())
        store.write(b"\1" * size)  # an object written into the store
        after = private_split_mib(os.getpid())
        assert after["object_store"] - before["object_store"] >= 60
        own = np.ones(32 << 20, np.uint8)  # the process's own heap
        grown = private_split_mib(os.getpid())
        assert grown["own"] - after["own"] >= 30 and abs(grown["object_store"] - after["object_store"]) < 4
        del own
    finally:
        store.close()
        os.unlink(path)


def test_lockstep_window_holds_consumers_within_the_spread():
    import threading

    from megascale_data_ext.commands.bench_soak import LockstepWindow

    stop = threading.Event()
    window = LockstepWindow(2, 1, stop)
    assert window.wait_turn(0) and window.wait_turn(1)  # step 1 may start while step 0 runs
    window.finished(0)
    window.finished(1)  # consumer A is through steps 0 and 1, B has not finished 0
    started = threading.Event()
    blocked = threading.Thread(target=lambda: window.wait_turn(2) and started.set())
    blocked.start()
    assert not started.wait(0.3)  # A may not start step 2 before B finished step 0
    window.finished(0)  # B finishes step 0: the slowest moved
    assert started.wait(5) and window.low == 1
    blocked.join()
    stop.set()
    assert LockstepWindow(2, -1, threading.Event()).wait_turn(1000)  # unbounded


def test_heap_profile_without_memray_is_one_named_error_before_anything_starts(monkeypatch, tmp_path):
    """`bench soak --heap-profile` on a machine without memray: a ConfigError naming the flag and
    the install, raised before Ray or any service starts."""
    import argparse
    import builtins

    import pytest

    from megascale_data_ext.commands import bench_soak
    from megascale_data_ext.errors import ConfigError

    real_import = builtins.__import__

    def no_memray(name, *args, **kwargs):
        if name == "memray":
            raise ImportError("No module named 'memray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_memray)
    parser = argparse.ArgumentParser()
    bench_soak.add_arguments(parser)
    args = parser.parse_args(["--heap-profile", str(tmp_path / "heap"), "--seconds", "1"])
    with pytest.raises(ConfigError, match=r"--heap-profile.*pip install memray"):
        bench_soak.run(args)
    assert not (tmp_path / "heap").exists()
