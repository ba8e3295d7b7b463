"""Starting Outrider server processes (workers) as children of this process; used by
benchmarks and system tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager

LISTENING = re.compile(r"listening on (\S+:\d+)")


@contextmanager
def outrider_process(*args: str, token: str | None = None, timeout: float = 120):
    """Run `outrider ARGS...`; yields (process, 'host:port') once it says it listens."""
    env = dict(os.environ, OUTRIDER_CLUSTER_TOKEN=token or "")
    proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc, _wait_listening(proc, timeout)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_listening(proc: subprocess.Popen, timeout: float) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if match := LISTENING.search(line):
            return match.group(1)
    raise RuntimeError("server did not start:\n" + "".join(seen[-20:]))
