"""Self-speculation by layer skipping (outrider/engine/layer_skip.py): the target's own
layers draft, through the one speculative step, and the output is the target's."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from outrider.cli.common import speculative_config
from outrider.core.hf_config import ModelConfigError
from outrider.core.sampling import SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.core.stats import SpecStats
from outrider.engine import layer_skip
from outrider.engine.layer_skip import (
    LAYER_SKIP_METHOD,
    cached_choice,
    layer_skip_proposer,
    parse_layers,
)
from outrider.engine.mix import ProposerMix
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.engine.tree import TreeShape
from tests.checkpoints import save_random_checkpoint

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14], [200, 2, 9, 77, 41, 8]]


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory, tokenizer_dir):
    return save_random_checkpoint(tmp_path_factory.mktemp("four"), "llama",
                                  tokenizer_from=tokenizer_dir, num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(four_layers) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(four_layers), kv_cache_mb=32))


def test_the_draft_is_the_targets_own_layers_and_its_output_the_targets(target):
    """Layers 0 and 2 draft: the target's modules themselves (no weight of its own), a
    KV cache of two layers holding as many positions as the target's; greedy output,
    chains and trees, AUTO beside the lookups, is the target's alone."""
    drafter = layer_skip_proposer(target.cfg, target, "0,2")
    runner = drafter.runner
    assert [id(m) for m in runner.model.layers] == [id(target.model.layers[i]) for i in (0, 2)]
    assert list(runner.model.parameters()) == [] and len(runner.kv_caches) == 2
    assert runner.blocks.num_free_blocks == target.blocks.num_free_blocks
    assert drafter.method == LAYER_SKIP_METHOD and drafter.drafts_trees
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [s.output_ids for s in SpeculativeDecoder(target, None).generate(PROMPTS, greedy, 0)]
    for tree in (None, TreeShape(2, 6)):
        mix = ProposerMix(drafter, target.vocab_size, ProposerKind.AUTO)
        decoder = SpeculativeDecoder(target, mix, tree=tree, choose_trees=False)
        seqs = decoder.generate(PROMPTS, greedy, 4)
        assert [s.output_ids for s in seqs] == alone, tree
        stats = SpecStats()
        for s in seqs:
            stats.merge(s.stats)
        drafted, kept = stats.by_proposer[LAYER_SKIP_METHOD]
        assert drafted > 0 and kept > 0, stats.by_proposer
        assert target.blocks.num_used_blocks == 0 == runner.blocks.num_used_blocks


def test_auto_searches_a_checkpoint_once_and_again_when_it_changes(target, tmp_path,
                                                                 monkeypatch):
    """"auto": the search's choice is a proper subset scored best of the subsets it
    kept (each a layer fewer, acceptance measured greedy and sampled); kept on disk, a
    restart reads it; a checkpoint whose files changed is searched again."""
    monkeypatch.setenv("OUTRIDER_LAYER_SKIP_CACHE", str(tmp_path))
    choice = cached_choice(target)
    [stored] = tmp_path.glob("*.json")
    record = json.loads(stored.read_text())
    searched = record["searched"]
    assert [len(c["kept"]) for c in searched] == [3, 2, 1]
    assert record["choice"] == max(searched, key=lambda c: c["speedup"])
    assert list(choice.kept) == record["choice"]["kept"]
    assert all(0 <= c["greedy_alpha"] <= 1 and 0 < c["sampled_alpha"] <= 1
               and 0 < c["cost"] < 1 for c in searched)
    # fewer layers read fewer weights
    assert [c["cost"] for c in searched] == sorted((c["cost"] for c in searched), reverse=True)

    def no_search(_):
        raise AssertionError("searched again")
    monkeypatch.setattr(layer_skip, "choose_layers", no_search)
    assert cached_choice(target).kept == choice.kept
    config = target.cfg.model_dir + "/config.json"
    os.utime(config, ns=(os.stat(config).st_atime_ns, os.stat(config).st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="searched again"):
        cached_choice(target)


@pytest.mark.parametrize("text, why", [("0,0", "increasing"), ("2,1", "increasing"),
                                       ("0,1,2,3", "fewer than all"), ("4", "0..3"),
                                       ("", "(none)"), ("a,b", "comma-separated")])
def test_layers_that_make_no_draft_are_refused_with_the_reason(text, why):
    with pytest.raises(ModelConfigError, match=why.replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)")):
        parse_layers(text, 4)


def test_the_speculative_config_names_layer_skip_as_vllm_names_its_methods():
    assert speculative_config('{"method": "layer_skip", "draft_layers": [0, 2]}') == {
        "method": "layer_skip", "draft_layers": [0, 2]}
    for bad, why in [('{"method": "layer_skip", "model": "x"}', "model: not taken"),
                     ('{"method": "layer_skip", "draft_layers": "all"}', "draft_layers"),
                     ('{"method": "layer_skips"}', "choose from")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            speculative_config(bad)


def test_generate_local_drafts_with_the_targets_layers_when_asked(four_layers, capsys):
    """`outrider generate --local` takes --self-draft-layers, and the layer_skip method of
    --speculative-config: its rounds draft through the target's layers (counted as
    layer_skip), its output the target's alone; with --draft as well, refused."""
    from outrider.cli import build_parser
    from outrider.cli.generate import _generate_local

    def run(*flags: str):
        args = build_parser("generate").parse_args(
            ["generate", "--local", "--json", "--target", str(four_layers), "--max-tokens",
             "24", "--ignore-eos", *flags, "def main():"])
        return _generate_local(args, args.prompt)

    alone = run("--gamma", "0")
    config = {"method": "layer_skip", "draft_layers": [0, 2], "num_speculative_tokens": 3}
    for flags in (("--self-draft-layers", "0,2", "--gamma", "3"),
                  ("--speculative-config", json.dumps(config))):
        result = run(*flags)
        assert result.token_ids == alone.token_ids, flags
        drafted, _ = result.speculation.by_proposer[LAYER_SKIP_METHOD]
        assert drafted > 0, result.speculation
    with pytest.raises(ValueError, match="without --draft"):
        run("--self-draft-layers", "0", "--draft", str(four_layers))
    capsys.readouterr()
