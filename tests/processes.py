"""Deployments the system tests start as real processes (outrider.launch.process_group)."""

from __future__ import annotations

import os


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


def listening_pid(port: int) -> int:
    """The process listening on a local TCP port (from /proc: its socket's inode)."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as table:
            rows += [line.split() for line in table.read().splitlines()[1:]]
    inodes = {row[9] for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            return int(pid)
    raise LookupError(f"nothing listens on port {port}")
