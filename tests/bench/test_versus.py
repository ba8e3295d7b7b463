"""The vLLM comparison's pure parts (outrider.bench.versus): prompts from installed
packages, server grouping, rounds merged, targets judged. vLLM itself never runs here."""

from __future__ import annotations

import pytest

from outrider import paths
from outrider.bench import versus
from outrider.core.tokenizer import Tokenizer


def test_prompts_come_from_installed_packages_not_the_repo():
    tokenizer = Tokenizer(str(paths.demo_target_dir()))
    prompts = versus.package_prompts(tokenizer, 24, 64)
    assert len(prompts) == 24 and len(set(prompts)) == 24
    assert all(0 < len(tokenizer.encode(p)) <= 66 for p in prompts)  # re-encoding may merge
    assert all("site-packages" in f.parts for f in versus.package_sources())


def test_outrider_modes_share_one_server_and_vllm_configurations_do_not():
    groups = versus.server_groups(["outrider-auto", "outrider-fixed4", "engine-g4",
                                   "vllm-draft4", "vllm"])
    assert groups == [["outrider-auto", "outrider-fixed4"], ["engine-g4"], ["vllm-draft4"],
                      ["vllm"]]


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
