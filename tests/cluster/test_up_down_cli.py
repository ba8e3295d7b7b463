"""`outrider up / status / down` as a user runs them: `up` starts a local Ray head (none
runs), brings the spec up and returns; `down` drains everything and stops that head."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from outrider.client import Client
from outrider.launch import free_port
from tests.cli_utils import run_cli
from tests.cluster.test_ray_cluster import write_spec

pytestmark = pytest.mark.slow


def ray_processes() -> list[str]:
    """Live Ray processes. Zombies are left out: they hold nothing, and where PID 1 does not
    reap (CI containers) a worker killed by an earlier test stays one until the end."""
    out = subprocess.run(["ps", "-eo", "stat=,pid=,args="], capture_output=True, text=True)
    pattern = re.compile(r"raylet|gcs_server|ray::")
    return [line.strip() for line in out.stdout.splitlines()
            if pattern.search(line) and not line.lstrip().startswith("Z")]


def ray_gone(timeout_s: float = 30) -> bool:
    """Whether no Ray process is left within timeout_s (a cluster that was just shut down,
    here or by the Ray tests just before, takes some seconds to exit)."""
    deadline = time.monotonic() + timeout_s
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    return ray_processes() == []


def test_up_status_down_leave_nothing_behind(tmp_path, llama_dir, draft_dir, redis_url):
    assert ray_gone(), "a Ray cluster is already running here"
    port = free_port()
    spec = write_spec(tmp_path / "spec.yaml", llama_dir, draft_dir, redis_url, port)
    try:
        up = run_cli("up", "-f", spec, timeout=400)
        assert up.returncode == 0, up.stderr
        assert f"router listening on 127.0.0.1:{port}" in up.stdout
        with Client(f"127.0.0.1:{port}", timeout_s=120) as client:
            assert len(client.generate([5, 6, 7], max_tokens=8, ignore_eos=True).token_ids) == 8
        status = run_cli("status", timeout=120)
        assert status.returncode == 0, status.stderr
        for role in ("target ", "target rank 1", "draft 0", "draft 1", "router"):
            assert role in status.stdout
        as_json = json.loads(run_cli("status", "--address", f"127.0.0.1:{port}",
                                     "--json").stdout)
        assert len(as_json["replicas"]) == 1
    finally:
        down = run_cli("down", timeout=300)
    assert down.returncode == 0 and "drained and removed" in down.stdout, down.stderr
    assert ray_gone(), ray_processes()
    again = run_cli("down", timeout=120)
    assert again.returncode == 0 and "nothing was running" in again.stdout
