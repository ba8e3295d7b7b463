"""Flags several `outrider` subcommands share: the roles (router, target-worker,
draft-worker) add them from their own modules, so they live here, not in outrider.cli."""

from __future__ import annotations

import argparse


def add_cpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", help="run on these CPU cores only, e.g. 0-2,5 (Linux; default: "
                                   "any)")


def add_metrics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free "
                        "port; default: off). Traces go to $OTEL_EXPORTER_OTLP_ENDPOINT")
