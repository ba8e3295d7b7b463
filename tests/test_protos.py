"""Committed gRPC stubs must be what `make protos` generates from protos/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(REPO / "protos")) for p in (REPO / "protos").rglob("*.proto"))
    assert protos, "no .proto sources"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'protos'}",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", *protos], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated
    stale = [str(rel) for rel in generated if not (REPO / rel).is_file()
             or (REPO / rel).read_text() != (tmp_path / rel).read_text()]
    assert not stale, f"stale or missing stubs (run `make protos`): {stale}"
