"""Deployments the system tests start as real processes (outrider.launch.process_group)."""

from __future__ import annotations


def two_targets_behind_a_router(start, target_dir, draft_dir):
    """One draft, two target replicas sharing it, and a router over both (gRPC only).
    Returns ({target address: its process}, router address): tests kill a target."""
    _, draft = start("draft-worker", "--model", str(draft_dir))
    targets = {}
    for _ in range(2):
        proc, address = start("target-worker", "--model", str(target_dir),
                              "--draft-address", draft)
        targets[address] = proc
    _, router = start("router", "--model", str(target_dir), "--port", "0", "--no-http",
                      *[a for t in targets for a in ("--target-address", t)])
    return targets, router
