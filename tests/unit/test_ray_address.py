"""An unreachable `data.ray.address` is a named error within seconds (Ray itself retries for minutes)."""

from __future__ import annotations

import socket
import threading
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


def test_a_host_that_does_not_resolve_fails_on_the_first_try_naming_where_the_address_came_from(monkeypatch):
    calls = []

    def no_such_host(endpoint, timeout):
        calls.append(endpoint)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_such_host)
    with pytest.raises(ConfigError, match=r"^`--address` 'nohost:6379': cannot resolve host 'nohost' \(Name or service "
                                          r"not known\); fix the address [^;]*$"):
        check_reachable("nohost:6379", seconds=30.0, key="--address")
    assert calls == [("nohost", 6379)]  # no retries for 30 s
    with pytest.raises(ConfigError, match=r"`data.ray.address` .*data.ray.address=null for an embedded local Ray"):
        check_reachable("nohost:6379")


def _serve_once(server: socket.socket, reply: bytes) -> None:
    """Accept one connection, read the client's first bytes and answer `reply`."""
    conn, _ = server.accept()
    with conn:
        conn.recv(64)
        conn.sendall(reply)
        time.sleep(0.5)


def _listening(reply: bytes | None) -> tuple[socket.socket, str]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    if reply is not None:  # else the kernel accepts the connection and nobody ever speaks
        threading.Thread(target=_serve_once, args=(server, reply), daemon=True).start()
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def test_a_grpc_server_passes():
    server, address = _listening(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # an HTTP/2 SETTINGS frame: what gRPC answers
    with server:
        check_reachable(address, seconds=2.0)
    check_reachable(None)  # an embedded Ray: nothing to probe


@pytest.mark.parametrize(("reply", "said"), [(None, "said nothing"), (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not gRPC")])
def test_tcp_without_ray_fails_within_30s_in_one_line_naming_the_key(reply, said):
    server, address = _listening(reply)
    t0 = time.monotonic()
    with server, pytest.raises(ConfigError) as err:
        check_reachable(address)
    assert time.monotonic() - t0 < 30
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"`data.ray.address` {address!r}: ")
    assert "accepts TCP but is no Ray cluster" in message and said in message


def test_auto_without_a_cluster_is_one_line_and_auto_resolves_as_ray_does(monkeypatch, tmp_path):
    """`data.ray.address=auto` on a machine where no Ray runs was every rank's `ConnectionError`
    traceback; it is found as `ray.init` finds it (RAY_ADDRESS, the address `ray start` recorded,
    a GCS process) and what it finds is probed like any address."""
    from megascale_data_ext.runtime import ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(ray_address, "_gcs_running", lambda: False)
    with pytest.raises(ConfigError, match=r"^`data.ray.address` 'auto': no Ray cluster runs on this machine .* "
                                          r"start one with `ray start --head`, or set data.ray.address=null"):
        check_reachable("auto")
    monkeypatch.setattr(ray_address, "_gcs_running", lambda: True)
    assert ray_address.current_cluster() == "auto"
    check_reachable("auto")  # a GCS runs without a recorded address: Ray finds it itself
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")  # a stopped `ray start` left it
    with pytest.raises(ConfigError, match=r"'127.0.0.1:1': nothing answers at 127.0.0.1:1"):
        check_reachable("auto", seconds=0.5)
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert ray_address.current_cluster() == "10.1.2.3:6379"
