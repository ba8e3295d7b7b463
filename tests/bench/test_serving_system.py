"""`outrider bench` end to end on a tiny sweep: the harness starts router + target +
draft on the demo pair, streams through the public API, and writes a consistent report."""

from __future__ import annotations

import json

import pytest

from outrider.bench import serving

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LEVELS = (1, 2)
MODES = ("off", "fixed4", "auto")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "serving.json"
    argv = ["--prompts", "1", "--prompt-tokens", "48", "--max-tokens", str(MAX_TOKENS),
            "--concurrency", ",".join(map(str, LEVELS)), "--modes", ",".join(MODES),
            "--workloads", "code", "--samplings", "greedy,t0.7-p0.95", "--threads", "1",
            "--out", str(out), "--quiet"]
    assert serving.main(argv) == 0
    return json.loads(out.read_text())


def test_every_cell_is_measured(report):
    cells = {(r["sampling"], r["mode"], r["concurrency"]) for r in report["rows"]}
    assert cells == {(s, m, c) for s in ("greedy", "t0.7-p0.95") for m in MODES for c in LEVELS}
    assert report["config"]["max_tokens"] == MAX_TOKENS
    assert {"tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "acceptance_rate",
            "mean_accepted_len", "gamma_histogram", "speedup_vs_off", "bound",
            "achieved_over_bound"} <= set(report["rows"][0])


def test_token_counts_and_rates_are_consistent(report):
    for row in report["rows"]:
        # one prompt: one request per stream at each level; ignore_eos: all max_tokens
        assert row["requests"] == row["concurrency"]
        assert row["tokens"] == row["completion_tokens"] == MAX_TOKENS * row["requests"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        assert 0 < row["ttft_ms_p50"] < 1e3 * row["seconds"]
        assert 0 < row["itl_ms_p50"] <= row["itl_ms_p99"]


def test_speculation_figures_match_the_mode(report):
    for row in report["rows"]:
        gammas = {int(g): n for g, n in row["gamma_histogram"].items()}
        if row["mode"] == "off" or (row["mode"] == "auto" and row["draft_tokens"] == 0):
            # auto may keep speculation off all along (sampled code: low acceptance)
            assert set(gammas) == {0} and row["draft_tokens"] == 0
            assert row["acceptance_rate"] is None and row["mean_accepted_len"] == 1.0
            continue
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert 1.0 <= row["mean_accepted_len"] <= 1 + max(gammas)
        # fixed4 at 4; auto under the replica's --auto-gamma-max (8 by default)
        assert max(gammas) <= (4 if row["mode"] == "fixed4" else 8)
        if row["mode"] == "fixed4":
            assert 4 in gammas


def test_speedup_and_bound_are_derived_from_the_measurements(report):
    c, replica = report["c"]["c"], report["c"]["replica_cost_model"]
    assert 0 < report["c"]["forward"]["c"] < 1
    # the replica's own cost model when it measured a draft cost, else the forward ratio
    if replica["c"]:
        assert report["c"]["source"] == "replica_cost_model" and c == replica["c"]
        assert c == pytest.approx(replica["draft_per_position_s"] / replica["verify_base_s"])
    else:
        assert report["c"]["source"] == "forward" and c == report["c"]["forward"]["c"]
    rows = {(r["sampling"], r["mode"], r["concurrency"]): r for r in report["rows"]}
    for (sampling, _mode, level), row in rows.items():
        off = rows[(sampling, "off", level)]
        assert row["speedup_vs_off"] == pytest.approx(row["tokens_per_s"] / off["tokens_per_s"])
        gammas = {int(g): n for g, n in row["gamma_histogram"].items()}
        alpha = row["acceptance_rate"] or 0.0
        tokens = sum(n * sum(alpha ** k for k in range(g + 1)) for g, n in gammas.items())
        cost = sum(n * (1 + c * g) for g, n in gammas.items())
        assert row["bound"] == pytest.approx(tokens / cost)
        assert row["achieved_over_bound"] == pytest.approx(row["speedup_vs_off"] / row["bound"])


def test_targets_and_plots_are_reported(report):
    names = [t["target"] for t in report["targets"]]
    assert "batch 1 greedy code: auto tokens/s over off" in names
    load = [t for t in report["targets"] if t.get("concurrency") is not None]
    assert {(t["sampling"], t["concurrency"]) for t in load} == {
        (s, c) for s in ("greedy", "t0.7-p0.95") for c in LEVELS}
    for t in report["targets"]:
        assert t["met"] == (t["value"] >= t["threshold"] if t["higher_is_better"]
                            else t["value"] <= t["threshold"])
    for path in report["plots"].values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
