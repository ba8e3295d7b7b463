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


def test_typed_records_match_the_messages_they_travel_in():
    """The engine's records fill their messages by field name (no positional unpacking):
    a field renamed or added on one side only must fail here, not on the wire."""
    from dataclasses import fields

    from outrider.core.load import ReplicaLoad
    from outrider.core.sequence import FinishReason, RoundStats
    from outrider.v1 import worker_pb2 as pb

    load_fields = set(pb.Load.DESCRIPTOR.fields_by_name)
    # (the service adds what the engine does not hold: its cost model, γ cap, metrics
    # port, vocabulary)
    assert {f.name for f in fields(ReplicaLoad)} == load_fields - {
        "cost", "gamma_max", "metrics_port", "target_vocab"}
    assert set(RoundStats._fields) == set(pb.RoundStats.DESCRIPTOR.fields_by_name)
    assert [r.value for r in FinishReason] == ["stop", "length", "cancelled", "error"]
