"""`outrider bench --adapt` end to end, cut short: the stream through `outrider serve
--adapt` with a throwaway Redis, the replay without training, the probe in process."""

from __future__ import annotations

import json

import pytest

from outrider.bench import adapt

pytestmark = pytest.mark.slow


def test_a_short_adapt_bench_reports_its_stream_replay_and_probe(tmp_path):
    out = tmp_path / "adapt.json"
    assert adapt.main(["--served-tokens", "600", "--max-tokens", "24", "--probe", "3",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests[-1]["served_tokens"] >= 600 and len(requests) >= 25
    assert all(0 <= r["accepted"] <= r["drafted"] for r in requests)
    assert report["summary"]["requests_compared"] >= 1
    probe = report["probe"]
    assert 0 < probe["acceptance_shipped"] <= 1
    if probe["version"] == 0:  # nothing adopted this soon: the same weights twice
        assert probe["acceptance_learnt"] == probe["acceptance_shipped"]
    assert report["config"]["probe"] == 3
