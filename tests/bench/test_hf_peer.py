"""The transformers comparison: side-by-side bookkeeping with stand-in runners, and a
tiny real run on the demo pair (every runner must return the target's greedy tokens)."""

from __future__ import annotations

import pytest

from outrider import paths
from outrider.bench.hf_peer import compare, ratios, side_by_side
from outrider.bench.prompts import workload_prompts
from outrider.core.tokenizer import Tokenizer


def test_side_by_side_rotates_and_counts():
    calls = []

    def runner(name, output):
        def run(prompt, max_tokens):
            calls.append(name)
            return output(prompt)[:max_tokens]
        return run

    runners = {"ref": runner("ref", lambda p: p * 3), "same": runner("same", lambda p: p * 3),
               "other": runner("other", lambda p: [9] * 9)}
    prompts = [[1, 2], [3], [4, 5]]
    result = side_by_side(runners, prompts, max_tokens=4, progress=False)
    # prompt i starts with runner i: every runner goes first once
    assert calls == ["ref", "same", "other", "same", "other", "ref", "other", "ref", "same"]
    assert result["ref"]["tokens"] == 4 + 3 + 4
    assert result["same"]["prompts_identical_to_reference"] == 3
    assert result["other"]["prompts_identical_to_reference"] == 0
    for r in result.values():
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])


def test_ratios_divide_tokens_per_second():
    results = {name: {"tokens_per_s": tps} for name, tps in {
        "transformers": 100.0, "transformers_assisted": 120.0,
        "transformers_assisted_g4": 150.0, "outrider_engine_off": 110.0,
        "outrider_engine_g4": 260.0, "deployment_off": 90.0, "deployment_auto": 240.0}.items()}
    r = ratios(results, gamma=4)
    assert r["deployment_auto_over_hf_assisted_best"] == pytest.approx(240 / 150)
    assert r["deployment_auto_over_hf_assisted_default"] == pytest.approx(240 / 120)
    assert r["engine_off_over_hf"] == pytest.approx(1.1)
    assert r["hf_assisted_best_over_hf"] == pytest.approx(1.5)
    assert r["deployment_fixed4_over_hf_assisted_best"] is None  # did not run


@pytest.mark.slow
def test_tiny_comparison_on_the_demo_pair():
    target, draft = str(paths.demo_target_dir()), str(paths.demo_draft_dir())
    prompts = workload_prompts(Tokenizer(target), "code", 1, 32)
    report = compare(target, draft, {"code": prompts}, max_tokens=8, gamma=4, progress=False)
    runners = report["workloads"]["code"]["runners"]
    assert set(runners) == {"transformers", "transformers_assisted", "transformers_assisted_g4",
                            "outrider_engine_off", "outrider_engine_g4"}
    for name, r in runners.items():
        assert r["tokens"] == 8, name
        assert r["prompts_identical_to_reference"] == 1, name  # greedy: the target's tokens
    ratio = report["workloads"]["code"]["ratios"]["engine_g4_over_engine_off"]
    assert ratio == pytest.approx(runners["outrider_engine_g4"]["tokens_per_s"]
                                  / runners["outrider_engine_off"]["tokens_per_s"])
