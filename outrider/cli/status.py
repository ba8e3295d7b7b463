"""`outrider status`: the Ray cluster's replicas when one runs here, else a router's."""

from __future__ import annotations

import argparse
import json

from outrider.cli.common import add_client_tls_args, client_tls


def status_flags(status: argparse.ArgumentParser) -> None:
    status.add_argument("--address", default=None,
                        help="router host:port (default: the Ray cluster's controller if one "
                             "runs here, else 127.0.0.1:50051)")
    status.add_argument("--ray-address", help="Ray cluster address for the cluster view")
    add_client_tls_args(status)
    status.add_argument("--tag", default="", help="only this workload tag's statistics")
    status.add_argument("--json", action="store_true", help="print the status as JSON")


def cmd_status(args) -> int:
    if args.address is None:
        table = _cluster_status(args.ray_address, args.json)
        if table is not None:
            print(table)
            return 0
        args.address = "127.0.0.1:50051"
    return _router_status(args)


def _cluster_status(ray_address: str | None, as_json: bool = False) -> str | None:
    """The controller's view (a table, or JSON), or None when no Ray cluster with one
    runs here."""
    import ray

    from outrider.cluster import launch

    try:
        handle = launch.controller(ray_address)
    except ConnectionError:
        return None
    if handle is None:
        return None
    status = ray.get(handle.status.remote())
    return json.dumps(status) if as_json else _cluster_table(status)


def _cluster_table(status: dict) -> str:
    rows = [("ROLE", "TARGET", "MODEL", "ADDRESS", "NODE", "DEVICE", "PID", "RSS MB", "HEAT",
             "TOK/S", "ALIVE")]
    rows += [(r["role"], str(r["target"]), r.get("model") or "-", r["address"], r["node_ip"],
              r["device"], str(r["pid"]), f"{r['rss_mb']:.0f}", _num(r["heat"], 2),
              _num(r["tokens_per_s"], 1), "yes" if r["alive"] else "NO")
             for r in status["rows"]]
    lines = [f"cluster endpoints: {status['endpoints']}", *_columns(rows)]
    router = status["endpoints"].get("router")
    if router:  # acceptance is counted by the router, not the controller
        from outrider.client import Client

        with Client(router, timeout_s=10) as client:
            lines += _acceptance_lines(client.status())
    return "\n".join(lines + [f"event: {e}" for e in status["events"][-5:]])


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _router_status(args) -> int:
    from google.protobuf.json_format import MessageToDict

    from outrider.client import Client

    with Client(args.address, tls=client_tls(args), timeout_s=10) as client:
        status = client.status(args.tag)
    if args.json:
        print(json.dumps(MessageToDict(status, always_print_fields_with_no_presence=True)))
    else:
        print(_router_table(args.address, status))
    return 0


def _router_table(address: str, status) -> str:
    store = "reachable" if status.is_store_reachable else "UNREACHABLE (serving from snapshot)"
    rows = [("REPLICA", "MODEL PAIR", "HEAT", "RUNNING", "WAITING", "KV BLOCKS", "TOK/S", "SEEN")]
    rows += [(r.address, r.model_pair, f"{r.heat:.2f}", str(r.num_running),
              str(r.num_waiting), f"{r.kv_used_blocks}/{r.kv_total_blocks}",
              f"{r.tokens_per_s:.1f}", f"{r.age_s:.1f}s ago") for r in status.replicas]
    lines = [f"router {address}; shared store {store}; {len(status.replicas)} replica(s)",
             *_columns(rows), *_acceptance_lines(status)]
    return "\n".join(lines)


def _acceptance_lines(status) -> list[str]:
    lines = []
    for a in status.acceptance:
        tested, accepted = sum(a.tested_per_position), sum(a.accepted_per_position)
        per_pos = " ".join(f"{x / t:.2f}" for x, t in zip(a.accepted_per_position,
                                                          a.tested_per_position) if t)
        lines.append(f"acceptance {a.model_pair} tag={a.tag or '-'}: "
                     f"α = {accepted / tested if tested else 0:.3f} over {tested} draft tokens; "
                     f"per position {per_pos or '-'}")
    return lines


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns, as wide as their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
