"""Fail fast on an unreachable Ray address instead of letting `ray.init` retry for minutes.

`ray.init(address="host:port")` keeps retrying a GCS that is not there (and under torchrun
every rank waits with it). Before joining, the address is probed with a plain TCP connect for
a bounded time; an address that never answers is a `ConfigError` naming ``data.ray.address``.

An address that accepts TCP but is no Ray cluster (another service on the port, a proxy that
holds the connection) would still leave `ray.init` retrying: so the probe then speaks the first
words of gRPC, which both the GCS and the Ray Client server talk: an HTTP/2 connection preface,
to which any gRPC server answers with a SETTINGS frame at once. Anything else within
`H2_SECONDS` is the same named error. With TLS (``RAY_USE_TLS=1``) the GCS speaks TLS first, so
only the TCP connect is checked.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.retry import Retry

DEFAULT_GCS_PORT = 6379
DEFAULT_CLIENT_PORT = 10001
PROBE_SECONDS = 15.0
H2_SECONDS = 5.0
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
_SETTINGS = 4


def host_port(address: str) -> tuple[str, int] | None:
    """The TCP endpoint of a Ray address; None for addresses Ray resolves itself ("auto", "local")."""
    if address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    rest, default = (address[len("ray://"):], DEFAULT_CLIENT_PORT) if client else (address, DEFAULT_GCS_PORT)
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    try:
        return (host or rest, int(port) if port else default)
    except ValueError:
        raise ConfigError(f"`data.ray.address` {address!r} has a bad port {port!r}; use host:port, ray://host:port "
                          "or auto") from None


def check_reachable(address: str | None, *, seconds: float = PROBE_SECONDS, key: str = "data.ray.address") -> None:
    """Raise `ConfigError` (naming `key`, where the address came from) if `address` accepts no TCP
    connection within `seconds`; a host name that does not resolve fails at once."""
    embedded = ", or set data.ray.address=null for an embedded local Ray" if key == "data.ray.address" else ""
    if address == "auto":
        found = current_cluster()
        if found is None:
            raise ConfigError(f"`{key}` 'auto': no Ray cluster runs on this machine (no RAY_ADDRESS, no address "
                              f"recorded by `ray start`, no GCS process); start one with `ray start --head`{embedded}")
        if found == "auto":  # a GCS process without a recorded address: Ray finds it itself
            return
        address = found
    endpoint = None if address is None else host_port(address)
    if endpoint is None:
        return
    retry = Retry(seconds, base_s=0.5, cap_s=0.5)
    last: OSError | None = None
    while not retry.expired():
        try:
            with socket.create_connection(endpoint, timeout=min(2.0, max(0.1, retry.left()))) as sock:
                if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
                    _speaks_grpc(sock, address, endpoint, key=key)
                return
        except socket.gaierror as exc:  # waiting does not make a name resolve
            raise ConfigError(f"`{key}` {address!r}: cannot resolve host {endpoint[0]!r} ({exc.strerror}); "
                              f"fix the address (the Ray head's host:port, as `ray start --head` prints it){embedded}"
                              ) from None
        except OSError as exc:
            last = exc
            retry.pause()
    raise ConfigError(f"`{key}` {address!r}: nothing answers at {endpoint[0]}:{endpoint[1]} after "
                      f"{seconds:g} s ({last}); start the Ray head there (`ray start --head`), fix the address"
                      f"{embedded}")


def current_cluster() -> str | None:
    """What ``ray.init(address="auto")`` joins, found as Ray finds it but without importing Ray:
    ``RAY_ADDRESS``, else the GCS address the last ``ray start`` on this machine recorded
    (``<RAY_TMPDIR or TMPDIR or /tmp>/ray/ray_current_cluster``), else "auto" when a GCS process
    runs here (Ray's own last resort), else None."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    try:
        recorded = Path(tmp, "ray", "ray_current_cluster").read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded
    return "auto" if _gcs_running() else None


def _gcs_running() -> bool:
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "gcs_server":
                return True
        except OSError:  # the process ended while we looked
            continue
    return False


def _speaks_grpc(sock: socket.socket, address: str, endpoint: tuple[str, int], seconds: float = H2_SECONDS, *,
                 key: str = "data.ray.address") -> None:
    """Raise `ConfigError` unless the peer answers an HTTP/2 preface with a SETTINGS frame (gRPC)."""
    what = "said nothing"
    try:
        sock.settimeout(seconds)
        sock.sendall(H2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                what = "closed the connection"
                break
            head += chunk
        if len(head) == 9 and head[3] == _SETTINGS:
            return
        if len(head) == 9:
            what = f"answered {head!r}, not gRPC"
    except OSError as exc:  # a timeout: it holds the connection and says nothing
        what = f"said nothing ({exc or type(exc).__name__})"
    raise ConfigError(f"`{key}` {address!r}: {endpoint[0]}:{endpoint[1]} accepts TCP but is no Ray "
                      f"cluster (to an HTTP/2 preface it {what} within {seconds:g} s); give the address of the Ray "
                      "head's GCS (`ray start --head` prints it, port 6379 by default) or ray://host:10001")
