"""Fail fast on an unreachable Ray address instead of letting `ray.init` retry for minutes.

`ray.init(address="host:port")` keeps retrying a GCS that is not there (and under torchrun
every rank waits with it). Before joining, the address is probed with a plain TCP connect for
a bounded time; an address that never answers is a `ConfigError` naming ``data.ray.address``.
"""

from __future__ import annotations

import socket
import time

from megascale_data_ext.errors import ConfigError

DEFAULT_GCS_PORT = 6379
DEFAULT_CLIENT_PORT = 10001
PROBE_SECONDS = 15.0


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


def check_reachable(address: str | None, *, seconds: float = PROBE_SECONDS) -> None:
    """Raise `ConfigError` if `address` accepts no TCP connection within `seconds`."""
    endpoint = None if address is None else host_port(address)
    if endpoint is None:
        return
    deadline = time.monotonic() + seconds
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(endpoint, timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.5)
    raise ConfigError(f"`data.ray.address` {address!r}: nothing answers at {endpoint[0]}:{endpoint[1]} after "
                      f"{seconds:g} s ({last}); start the Ray head there (`ray start --head`), fix the address, "
                      "or set data.ray.address=null for an embedded local Ray")
