"""The proposer benchmark's pure parts (outrider.bench.proposers): copy-heavy prompts
built from installed packages, the lookups' own cost, targets judged, and the `outrider
bench --proposers` flag. vLLM itself never runs here."""

from __future__ import annotations

import pytest

from outrider import paths
from outrider.bench import proposers
from outrider.cli import build_parser
from outrider.cli.bench import _chosen_benchmark
from outrider.core.tokenizer import Tokenizer


def test_copy_heavy_prompts_repeat_what_the_model_should_copy():
    edited = proposers.edited_in_place(3)
    for prompt in edited:  # a function, then its def line again under a new name
        first, again = prompt.split("\n\n\n")
        name = first.strip().split("(")[0].removeprefix("def ")
        assert again.startswith(f"def {name}_v2(") or f"def {name}_v2(" in again
        assert again.splitlines()[1] in first
    quoted = proposers.quoted_documents(3)
    for prompt in quoted:  # a docstring, then the start of a quote of it
        doc, ask = prompt.rsplit('"""', 1)
        assert "Quote the text above" in ask
        assert ask.split('# "', 1)[1] in " ".join(doc.split())
    assert len(proposers.copy_prompts(6)) == 6


def test_lookup_cost_is_measured_per_round():
    tokenizer = Tokenizer(str(paths.demo_target_dir()))
    cost = proposers.lookup_cost(tokenizer, proposers.copy_prompts(4), gamma=8)
    assert set(cost) == {"ngram", "suffix"}
    assert all(0 < c["us_per_round"] < 10_000 and c["mean_context_tokens"] > 50
               for c in cost.values())


def cell(value: float) -> dict:
    return {"tokens_per_s": value, "ttft_ms_p50": 10.0}


def test_targets_compare_auto_with_vllms_better_configuration_and_with_the_model():
    def row(copy, *plain):
        return {"copy-c1": cell(copy), **{f"plain-c{c}": cell(v)
                                          for c, v in zip((1, 8, 32), plain)}}
    results = {"outrider-auto": row(500, 300, 800, 1000),
               "outrider-model": row(400, 300, 850, 1000),
               "vllm-ngram": row(300, 0, 0, 0), "vllm-draft": row(380, 0, 0, 0)}
    judged = {(t["target"], t["concurrency"]): t for t in proposers.targets(results)}
    vs_vllm = judged[("copy-heavy: auto over vLLM's better of n-gram and draft model", 1)]
    assert vs_vllm["value"] == pytest.approx(500 / 380) and vs_vllm["met"]
    assert judged[("copy-heavy: auto over --proposer model", 1)]["met"]       # 1.25 >= 1.15
    assert judged[("plain code: auto over --proposer model", 1)]["met"]       # 1.0
    assert not judged[("plain code: auto over --proposer model", 8)]["met"]   # 0.94 < 0.97


def test_the_bench_flag_picks_the_proposer_benchmark():
    args = build_parser().parse_args(["bench", "--proposers", "--vllm", "/x"])
    assert _chosen_benchmark(args) is proposers
    assert args.copy_tokens == 128 and args.proposer_systems == "outrider,vllm-ngram,vllm-draft"
