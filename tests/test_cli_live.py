"""`outrider generate` and `outrider status` against a live router, target and draft."""

from __future__ import annotations

import json

import pytest

from outrider.client import Client
from outrider.local_system import LocalSystemConfig, local_system
from tests.cli_utils import run_cli

pytestmark = pytest.mark.slow

PROMPT = "import os\n"


@pytest.fixture(scope="module")
def router(llama_dir, draft_dir):
    cfg = LocalSystemConfig(str(llama_dir), str(draft_dir), grpc_port=0, kv_cache_mb=8)
    with local_system(cfg) as system:
        yield system.router


def test_generate_streams_prints_stats_and_json(router):
    args = ("--address", router, "--max-tokens", "12", "--temperature", "0", "--gamma", "3")
    out = run_cli("generate", "--json", *args, PROMPT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    with Client(router, timeout_s=60) as client:
        same = client.generate(PROMPT, max_tokens=12, temperature=0.0, speculation="fixed",
                               gamma_max=3)
    assert result["token_ids"] == list(same.token_ids) and result["text"] == same.text
    assert result["replica"] == same.replica and result["speculation"]["rounds"] >= 1
    streamed = run_cli("generate", "--stats", *args, PROMPT)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == same.text + "\n"
    assert f"on {same.replica}" in streamed.stderr and "α = " in streamed.stderr


def test_status_shows_the_replicas(router):
    table = run_cli("status", "--address", router)
    assert table.returncode == 0, table.stderr
    assert "1 replica(s)" in table.stdout and "HEAT" in table.stdout
    status = json.loads(run_cli("status", "--address", router, "--json").stdout)
    assert len(status["replicas"]) == 1 and status["isStoreReachable"] is True
