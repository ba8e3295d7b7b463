"""The benchmark harness's arithmetic, without processes: the analytic bound, percentiles,
per-token gaps, aggregation into a row, speedups, targets and the Markdown report."""

from __future__ import annotations

import random

import numpy as np
import pytest

from outrider import paths
from outrider.bench.common import Mode, RequestRecord
from outrider.bench.prompts import text_prompts
from outrider.bench.serving import (
    add_comparisons,
    batch1_targets,
    batches,
    load_targets,
    mixed_speedup_bound,
    per_token_gaps,
    percentile,
    rotated,
    speedup_bound,
    summarize,
)
from outrider.bench.tables import serving_markdown
from outrider.core.tokenizer import Tokenizer
from outrider.v1 import generate_pb2 as gp


def test_bound_matches_hand_computed_values():
    # (1 - 0.8^5) / ((1 - 0.8) * (1 + 0.1 * 4)) = 0.67232 / 0.28
    assert speedup_bound(0.8, 4, 0.1) == pytest.approx(2.4011428571)
    assert speedup_bound(1.0, 3, 0.0) == pytest.approx(4.0)   # every draft token accepted
    assert speedup_bound(0.0, 4, 0.25) == pytest.approx(0.5)  # nothing accepted: pure cost
    assert speedup_bound(0.5, 0, 0.3) == pytest.approx(1.0)


def test_mixed_bound_over_rounds():
    assert mixed_speedup_bound(0.8, {4: 7}, 0.1) == pytest.approx(speedup_bound(0.8, 4, 0.1))
    assert mixed_speedup_bound(None, {0: 12}, 0.1) == 1.0
    assert mixed_speedup_bound(None, {}, 0.1) == 1.0
    # one γ=0 round (1 token, cost 1) and one γ=4 round (3.3616 tokens, cost 1.4)
    assert mixed_speedup_bound(0.8, {0: 1, 4: 1}, 0.1) == pytest.approx(4.3616 / 2.4)


def test_percentile_agrees_with_numpy():
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def record(start, deltas, rounds=(), draft=0, accepted=0, num_rounds=0) -> RequestRecord:
    r = RequestRecord(start=start, end=deltas[-1][0], deltas=list(deltas), rounds=list(rounds),
                      draft_tokens=draft, accepted_tokens=accepted, num_rounds=num_rounds)
    r.completion_tokens = r.num_tokens
    return r


def test_per_token_gaps_share_a_delta_among_its_tokens():
    r = record(0.9, [(1.0, 2), (1.01, 1), (1.04, 3)])
    assert r.ttft == pytest.approx(0.1)
    assert per_token_gaps(r) == pytest.approx([0.01, 0.01, 0.01, 0.01])
    assert per_token_gaps(record(0.0, [(0.5, 4)])) == []


def test_summarize_aggregates_requests():
    a = record(0.0, [(0.1, 1), (0.2, 4)], rounds=[(0, 0), (4, 3)], draft=4, accepted=3,
               num_rounds=2)
    b = record(0.0, [(0.3, 3), (0.5, 2)], rounds=[(4, 2), (2, 1)], draft=6, accepted=3,
               num_rounds=2)
    row = summarize([a, b], seconds=0.5)
    assert row["tokens"] == row["completion_tokens"] == 10
    assert row["tokens_per_s"] == pytest.approx(20.0)
    assert row["acceptance_rate"] == pytest.approx(6 / 10)
    assert row["mean_accepted_len"] == pytest.approx((6 + 4) / 4)
    assert row["gamma_histogram"] == {"0": 1, "2": 1, "4": 2}
    assert row["mean_gamma"] == pytest.approx(10 / 4)
    assert row["ttft_ms_p50"] == pytest.approx(200.0)  # TTFTs 0.1 and 0.3 s
    gaps = [0.1 / 4] * 4 + [0.2 / 2] * 2
    assert row["itl_ms_p50"] == pytest.approx(1e3 * float(np.percentile(gaps, 50)))
    assert row["itl_ms_p99"] == pytest.approx(1e3 * float(np.percentile(gaps, 99)))
    off = summarize([record(0.0, [(0.1, 1), (0.2, 1)], rounds=[(0, 0), (0, 0)],
                            num_rounds=2)], 0.2)
    assert off["acceptance_rate"] is None and off["mean_accepted_len"] == 1.0


def make_row(mode, tps, concurrency=1, alpha=None, gammas=None, itl=5.0, **key):
    return {"workload": key.get("workload", "code"), "sampling": key.get("sampling", "greedy"),
            "mode": mode, "concurrency": concurrency, "tokens_per_s": tps,
            "acceptance_rate": alpha, "gamma_histogram": gammas or {"0": 10},
            "itl_ms_p50": itl}


def test_comparisons_are_ratios_of_measured_numbers():
    rows = [make_row("off", 100.0), make_row("fixed4", 250.0, alpha=0.8, gammas={"4": 9}),
            make_row("off", 300.0, concurrency=8), make_row("auto", 360.0, concurrency=8,
                                                             alpha=0.8, gammas={"0": 1, "4": 1})]
    add_comparisons(rows, c=0.1, c_alt=0.0)
    assert rows[0]["speedup_vs_off"] == 1.0 and rows[0]["bound"] == 1.0
    assert rows[1]["speedup_vs_off"] == pytest.approx(2.5)
    assert rows[1]["bound"] == pytest.approx(2.4011428571)
    assert rows[1]["achieved_over_bound"] == pytest.approx(2.5 / 2.4011428571)
    assert rows[1]["bound_alt_c"] == pytest.approx(3.3616)
    assert rows[3]["speedup_vs_off"] == pytest.approx(1.2)  # against off at its own level
    assert rows[3]["bound"] == pytest.approx(4.3616 / 2.4)


def test_load_target_compares_auto_with_the_best_other_mode():
    rows = [make_row("off", 100.0), make_row("fixed4", 200.0), make_row("auto", 195.0),
            make_row("off", 400.0, concurrency=32), make_row("fixed4", 380.0, concurrency=32),
            make_row("auto", 380.0, concurrency=32)]
    by_level = {t["concurrency"]: t for t in load_targets(rows)}
    assert by_level[1]["met"] and by_level[1]["best_mode"] == "fixed4"
    assert by_level[1]["value"] == pytest.approx(0.975)
    assert not by_level[32]["met"] and by_level[32]["best_mode"] == "off"


def test_batch1_targets_direction():
    rows = [make_row("off", 100.0, itl=10.0), make_row("auto", 210.0, itl=6.0, alpha=0.9,
                                                       gammas={"4": 5})]
    add_comparisons(rows, c=0.1)
    found = {t["target"]: t for t in batch1_targets(rows)}
    speed = found["batch 1 greedy code: auto tokens/s over off"]
    assert speed["met"] and speed["value"] == pytest.approx(2.1)
    itl = found["concurrency 1 greedy code: auto ITL p50 over off ITL p50"]
    assert itl["value"] == pytest.approx(0.6) and itl["met"] is False
    assert batch1_targets([make_row("off", 1.0)]) == []


def test_modes_parse_to_api_fields():
    assert Mode.parse("off") == Mode("off", gp.SPECULATION_MODE_OFF, 0)
    assert Mode.parse("fixed6") == Mode("fixed6", gp.SPECULATION_MODE_FIXED, 6)
    assert Mode.parse("auto") == Mode("auto", gp.SPECULATION_MODE_AUTO, 0)
    assert Mode.parse("auto8").gamma == 8
    for bad in ("fixed", "fast", "fixedx", "on"):
        with pytest.raises(ValueError):
            Mode.parse(bad)


def test_batches_cover_every_prompt_with_full_batches():
    assert batches(4, 1) == [[0], [1], [2], [3]]
    assert batches(5, 2) == [[0, 1], [2, 3], [4, 5]]
    assert batches(4, 32) == [list(range(32))]
    assert batches(2, 1, repeats=2) == [[0], [1], [2], [3]]
    assert rotated([1, 2, 3], 4) == [2, 3, 1]


def test_sampling_settings_match_the_acceptance_benchmark():
    from outrider.bench import acceptance, serving

    assert acceptance.SETTINGS.items() <= serving.SETTINGS.items()
    assert {"greedy", "t0.7-p0.9", "t1.0"} <= acceptance.SETTINGS.keys()


def test_the_versus_clients_temperature_and_top_p_join_its_sampling_flags():
    from outrider.bench.versus import with_sampling_flags

    assert with_sampling_flags("temperature=0", 0.7, 0.9) == "temperature=0.7,top_p=0.9"
    assert (with_sampling_flags("temperature=0.8,logprobs=2", None, 0.5)
            == "temperature=0.8,logprobs=2,top_p=0.5")


def test_text_prompts_are_prose_paragraphs():
    tokenizer = Tokenizer(paths.demo_target_dir())
    prompts = text_prompts(tokenizer, 100)
    assert len(prompts) >= 4 and all(len(p) > 20 for p in prompts)
    assert len(text_prompts(tokenizer, 2)) == 2
    assert not tokenizer.decode(prompts[0]).startswith("#")


def test_markdown_report_shows_the_rows_and_targets():
    rows = [make_row("off", 100.0), make_row("auto", 230.0, alpha=0.9, gammas={"4": 3})]
    for r in rows:
        r.update(ttft_ms_p50=50.0, itl_ms_p99=9.0, mean_accepted_len=4.1)
    add_comparisons(rows, c=0.1)
    doc = serving_markdown({"rows": rows, "config": {"modes": ["off", "auto"]},
                              "targets": batch1_targets(rows)})
    assert "| 1 | auto | 230.0 | 2.30 |" in doc
    assert "γ4 100%" in doc and "**not met**" in doc
