from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outrider.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def generate_json(*args: str, timeout: float = 240) -> dict:
    proc = run_cli("generate", "--local", "--json", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
