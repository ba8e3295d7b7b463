"""`outrider up` and `outrider down`: a Ray cluster brought up from a spec and taken down.
(This is the command line's module; the deployment itself is the outrider.cluster package.)"""

from __future__ import annotations

import argparse

from outrider.cli.common import stop_on_signals

CLUSTER_EXAMPLES = """examples:
  redis-server --port 6379 --daemonize yes
  outrider up -f deploy/cluster/cpu.yaml     # starts a local Ray head if none runs
  outrider status                            # replicas: node, device, heat, tokens/s
  outrider generate "def fibonacci(n):"
  outrider down                              # drains, removes actors and placement groups
"""


def up_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument("-f", "--file", required=True, help="cluster spec (YAML)")
    up.add_argument("--address", help="Ray cluster address (default: the local one, "
                                      "started if missing; 'auto' inside a Ray job)")
    up.add_argument("--wait", action="store_true",
                    help="stay in the foreground; SIGTERM/Ctrl-C brings it down (RayJob)")


def down_flags(down: argparse.ArgumentParser) -> None:
    down.add_argument("--address", help="Ray cluster address (default: the local one)")


def cmd_up(args) -> int:
    from outrider.cluster import launch

    endpoints, seconds = launch.up(args.file, args.address)
    print(f"outrider up: {_where(endpoints)} ({seconds:.1f} s)", flush=True)
    if args.wait:
        from outrider.grpc_server import wait_until_set

        wait_until_set(stop_on_signals())
        launch.down(args.address)
        print("outrider up: brought down", flush=True)
    return 0


def _where(endpoints: dict) -> str:
    """Where clients reach the cluster: its router, or, in a spec without one, its target
    replicas (routers outside Ray send to them)."""
    if not endpoints["router"]:
        return (f"target replicas at {', '.join(endpoints['targets'])} (routers run "
                "elsewhere)")
    http = (f"; OpenAI-compatible API at http://{endpoints['http']}/v1"
            if endpoints.get("http") else "")
    return f"router listening on {endpoints['router']}{http}"


def cmd_down(args) -> int:
    from outrider.cluster import launch

    print("outrider down: " + ("drained and removed" if launch.down(args.address)
                               else "nothing was running"))
    return 0
