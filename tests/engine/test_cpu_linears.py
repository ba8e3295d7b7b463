"""CPU linears through oneDNN (outrider/engine/parallel.py `PackedForCPU`): row counts
rounded to a bounded set (compiled.onednn_rows), prepared at start by serving replicas, so
their memory stays flat whatever the batch sizes (docs/RELIABILITY.md "Load and soak")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from outrider import paths
from outrider.engine.compiled import onednn_linear, onednn_rows
from outrider.engine.parallel import PackedForCPU
from outrider.engine.runner import ModelRunner, RunnerConfig


def rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_row_counts_are_exact_up_to_32_then_rounded_by_at_most_a_sixteenth():
    for rows in range(0, 4097):
        padded = onednn_rows(rows)
        assert rows <= padded <= rows * (1 + 1 / 16), rows
        assert padded == rows or rows > 32
    assert len({onednn_rows(rows) for rows in range(1, 513)}) == 96


def test_a_padded_linear_is_the_plain_linear_of_its_rows():
    torch.manual_seed(0)
    weight = torch.randn(96, 40)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    for rows in (1, 17, 33, 100, 257, 513, 1100):  # past ONEDNN_MAX_ROWS: in pieces
        x = torch.randn(rows, 40)
        out = onednn_linear(x, packed)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-4)


def forward_growth_mb(prepared_rows: int) -> dict:
    """In this process, new since its start: RSS growth over forwards of 1-160 tokens
    through the demo target prepared for `prepared_rows`, and how many linears it packed.
    Each row count oneDNN multiplies (onednn_rows) once, and counts between them that
    round up to one: every count would cost 3.7x the tokens and see no other shape."""
    runner = ModelRunner(RunnerConfig(str(paths.demo_target_dir()), kv_cache_mb=16,
                                      prepared_rows=prepared_rows))
    runner._scratch_forward(1, 1)
    before = rss_mb()
    for num_tokens in sorted({onednn_rows(n) for n in range(1, 161)} | {33, 67, 131, 159}):
        runner._scratch_forward(num_tokens, 1)
    packed = sum(isinstance(m, PackedForCPU) and m.weight_packed is not None
                 for m in runner.model.modules())
    return {"growth_mb": rss_mb() - before, "packed": packed}


def in_a_fresh_process(prepared_rows: int) -> dict:
    """forward_growth_mb where no earlier test has built oneDNN primitives already."""
    code = ("import json; from tests.engine.test_cpu_linears import forward_growth_mb; "
            f"print(json.dumps(forward_growth_mb({prepared_rows})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_prepared_replica_forwards_any_number_of_tokens_in_flat_memory():
    """oneDNN keeps a primitive (~0.6 MB) per shape it sees: unprepared, these 160 token
    counts grow a process by ~3 MB each (a soak's target grew for minutes); prepared at
    start, the same forwards leave it flat."""
    prepared, unprepared = in_a_fresh_process(160), in_a_fresh_process(0)
    assert prepared["packed"] > 0 and unprepared["packed"] == prepared["packed"]  # oneDNN's path
    assert prepared["growth_mb"] < 40, prepared
    assert unprepared["growth_mb"] > 100, unprepared  # what the preparation saves, seen here
