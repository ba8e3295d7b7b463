"""The router, the SDK and the torch-free core import and run with torch, Ray and
safetensors made unimportable: a router replica or an SDK install carries none of them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from outrider import paths

# Python run with a finder that refuses the heavy packages, then the given code
BLOCKED = """
import sys
REFUSED = {"torch", "ray", "safetensors"}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:  # as if it were not installed
            raise ModuleNotFoundError(f"{name} is made unimportable by this test", name=name)
sys.meta_path.insert(0, Refuse())
"""

TORCH_FREE = ["outrider.core.sampling", "outrider.core.policy", "outrider.core.stats",
              "outrider.core.hf_config", "outrider.core.tokenizer", "outrider.state",
              "outrider.client", "outrider.router.main",
              "outrider.router.service", "outrider.router.http_api", "outrider.cli"]


def run_blocked(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED + code], capture_output=True,
                          text=True, timeout=timeout)


def test_the_blocker_really_blocks_torch():
    done = run_blocked("import outrider.engine.sampling")
    assert done.returncode != 0 and "made unimportable" in done.stderr


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    done = run_blocked(f"import {module}")
    assert done.returncode == 0, done.stderr


def test_a_command_whose_extra_is_missing_says_which_to_install():
    done = run_blocked("REFUSED.add('numpy')\nfrom outrider.cli import main\n"
                       "raise SystemExit(main(['serve']))")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "outrider: error: `outrider serve` needs the 'numpy' package, which this install "
        "lacks: pip install 'outrider[all]' (on a CPU machine, torch's CPU build first)"]


@pytest.mark.slow
def test_a_router_starts_and_answers_without_torch():
    """A router with no replica: it listens, and a request is refused as UNAVAILABLE (not
    a crash) — the whole request path up to replica choice runs without torch."""
    code = f"""
import threading, time, grpc
from outrider.cli import main
from outrider.client import Client, UnavailableError
from outrider.launch import free_port
port = free_port()
argv = ["router", "--model", {str(paths.demo_target_dir())!r}, "--port", str(port), "--no-http"]
threading.Thread(target=main, args=(argv,), daemon=True).start()
with Client(f"127.0.0.1:{{port}}", timeout_s=60, retry=None) as client:
    try:
        client.generate("def f(x):", max_tokens=4)
    except UnavailableError as exc:
        print("refused:", exc.message)
import sys
print("torch loaded:", "torch" in sys.modules)
"""
    done = run_blocked(code, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "torch loaded: False" in done.stdout


def test_the_router_imports_nothing_of_the_engine():
    """What router and engine both need (limits, sampling rules) lives in outrider/core:
    the router reads no engine module, not even one that happens to be torch-free."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / "router").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith("outrider.engine")]
    assert not found
