"""An unreachable `data.ray.address` is a named error within seconds (Ray itself retries for minutes)."""

from __future__ import annotations

import socket
import time

import pytest

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.ray_address import check_reachable, host_port


def test_addresses_parse_to_their_endpoints():
    assert host_port("10.0.0.1:6380") == ("10.0.0.1", 6380)
    assert host_port("head") == ("head", 6379)
    assert host_port("ray://head:10002") == ("head", 10002) and host_port("ray://head") == ("head", 10001)
    assert host_port("auto") is None
    with pytest.raises(ConfigError, match="bad port 'x'"):
        host_port("head:x")


def test_unreachable_address_fails_fast_naming_the_key():
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"`data.ray.address` '127.0.0.1:1': nothing answers .*ray start --head"):
        check_reachable("127.0.0.1:1", seconds=1.0)
    assert time.monotonic() - t0 < 10


def test_a_listening_address_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}", seconds=2.0)
    check_reachable(None)
    check_reachable("auto")
