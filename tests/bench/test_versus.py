"""The vLLM comparison's pure parts (outrider.bench.versus): prompts from installed
packages, server grouping, rounds merged, targets judged. vLLM itself never runs here."""

from __future__ import annotations

import pytest

from outrider import paths
from outrider.bench import versus
from outrider.bench.prompts import package_prompts, package_sources
from outrider.core.tokenizer import Tokenizer


def test_prompts_come_from_installed_packages_not_the_repo():
    tokenizer = Tokenizer(str(paths.demo_target_dir()))
    prompts = package_prompts(tokenizer, 24, 64)
    assert len(prompts) == 24 and len(set(prompts)) == 24
    assert all(0 < len(tokenizer.encode(p)) <= 66 for p in prompts)  # re-encoding may merge
    assert all("site-packages" in f.parts for f in package_sources())


def test_outrider_modes_share_one_server_and_vllm_configurations_do_not():
    groups = versus.server_groups(["outrider-auto", "outrider-fixed4", "engine-g4",
                                   "vllm-draft4", "vllm"])
    assert groups == [["outrider-auto", "outrider-fixed4"], ["engine-g4"], ["vllm-draft4"],
                      ["vllm"]]
    # a server with no draft model (or a head) is a server of its own
    assert versus.server_groups(["outrider-off", "outrider-lookups", "vllm-ngram"]) == [
        ["outrider-off"], ["outrider-lookups"], ["vllm-ngram"]]


def test_every_other_round_reverses_the_servers_and_the_modes_sharing_one():
    groups = versus.server_groups(["outrider-auto", "outrider-off", "vllm"])
    assert versus.in_order(groups, 0) == [["outrider-auto", "outrider-off"], ["vllm"]]
    assert versus.in_order(groups, 1) == [["vllm"], ["outrider-off", "outrider-auto"]]


def cells(*values):
    return {c: {"tokens_per_s": v, "ttft_ms_p50": 10.0 * c} for c, v in zip((1, 8, 32), values)}


def test_rounds_are_averaged_and_targets_judged():
    rounds = [{"outrider-auto": cells(400, 900, 1300)}, {"outrider-auto": cells(200, 700, 1100)}]
    merged = versus.merge_rounds(rounds)["outrider-auto"]
    assert merged[1]["tokens_per_s"] == 300 and merged[1]["tokens_per_s_rounds"] == [400, 200]
    results = {"outrider-auto": cells(400, 900, 1300), "outrider-fixed4": cells(350, 800, 1000),
               "engine-g4": cells(400, 1000, 1600), "vllm-draft4": cells(300, 950, 1200),
               "vllm": cells(130, 700, 1250)}
    judged = {(t["target"], t.get("concurrency")): t for t in versus.targets(results, 4)}
    assert judged[("AUTO over vLLM with the draft model", 1)]["value"] == pytest.approx(4 / 3)
    assert judged[("AUTO over vLLM with the draft model", 1)]["met"]
    assert not judged[("AUTO over vLLM's better configuration", 8)]["met"]   # 900 < 950
    assert judged[("AUTO over vLLM's better configuration", 32)]["met"]      # 1300 > 1250
    assert not judged[("served AUTO over the in-process engine γ=4", 32)]["met"]


def test_the_engine_threads_time_splits_into_cpu_proposer_and_the_rest():
    """Over a 10 s level, 1,000 steps took 8 s: 5 s on the thread's CPU, 1 s waiting for
    the proposer, so 2 s (a quarter) waiting for the process's other threads."""
    before = {"steps": 100, "wall": 1.0, "cpu": 0.5, "proposer_wait": 0.1, "voluntary": 50}
    after = {"steps": 1100, "wall": 9.0, "cpu": 5.5, "proposer_wait": 1.1, "voluntary": 3050}
    x = versus.engine_cell(before, after, 10.0)
    assert x["engine_in_steps"] == pytest.approx(0.8)
    assert x["engine_cpu"] == pytest.approx(5 / 8)
    assert x["engine_proposer_wait"] == pytest.approx(1 / 8)
    assert x["engine_other_wait"] == pytest.approx(2 / 8)
    assert x["engine_steps_per_s"] == pytest.approx(100) and x["engine_switches_per_step"] == 3
    table = versus.engine_table({"outrider-auto": {32: x}, "vllm": {32: {"tokens_per_s": 1}}})
    assert x["engine_step_ms"] == pytest.approx(8)
    assert "| outrider-auto | 32 | 100 | 8.0 | 80% | 62% | 12% | 25% | 3.0 |" in table
    assert "vllm" not in table
