"""`megascale-data status`: every actor of a running data service — role, state, pid, node, home,
restarts and what it serves — asked of the Ray cluster it runs on (the address and namespace
`serve` printed; with token authentication, the ``RAY_AUTH_*`` variables it printed too).

Nothing is asked of the actors themselves except which sources each loader serves, so the table
answers while actors restart; it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

from megascale_data_ext.commands._config_args import fail
from megascale_data_ext.errors import ConfigError, MegascaleDataError

NAME = "status"
HELP = "list the actors of a running data service (role, pid, node, home, restarts, sources)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, help="the Ray address `serve` printed (data.ray.address)")
    parser.add_argument("--namespace", default="megascale", help="the service's namespace (default: megascale)")
    parser.add_argument("--json", action="store_true", help="one JSON object per actor instead of a table")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="most seconds to wait for restarting loaders to say what they serve (default 60)")


def run(args: argparse.Namespace) -> int:
    import ray

    from megascale_data_ext.runtime.actor_table import actor_rows, find_service, format_table
    from megascale_data_ext.runtime.ray_address import PROBE_SECONDS
    from megascale_data_ext.runtime.remote import join_ray

    try:
        join_ray(args.address, args.namespace, key="--address", probe_seconds=min(args.timeout, PROBE_SECONDS))
        try:
            planner, constructors, topology = find_service(args.namespace)
        except ValueError:
            raise ConfigError(f"no data service runs in Ray namespace {args.namespace!r} on {args.address}: start one "
                              "with `megascale-data serve`, or pass the --namespace it printed") from None
        rows = [row for row, _ in actor_rows(planner, constructors, topology, timeout_s=args.timeout)]
    except MegascaleDataError as exc:
        return fail(exc)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"data service {topology.job or args.namespace!r}: {len(rows)} actors")
        print(format_table(rows))
    sys.stdout.flush()
    return 0
