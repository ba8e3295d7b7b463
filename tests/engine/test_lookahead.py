"""Lookahead without a draft (outrider/engine/lookahead.py): Jacobi guesses from the
target's own verification rows, their pool and the request's n-gram lookup, through the
one speculative step; greedy output is the target's."""

from __future__ import annotations

import pytest

from outrider import paths
from outrider.core.sampling import SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.core.stats import SpecStats
from outrider.core.tokenizer import Tokenizer
from outrider.engine import lookahead
from outrider.engine.lookahead import GUESS_MATCH, Lookahead
from outrider.engine.mix import ProposerMix
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder


def test_the_texts_own_match_leads_then_the_fresh_guesses_then_the_pool():
    la = Lookahead()
    # no repeat in the text: the target's guesses for what follows
    assert la.propose([1, 2, 3], [7, 8, 9, 10], 3) == ([7, 8, 9], GUESS_MATCH)
    # a round that kept everything leaves no guesses: the pool's, guessed after token 8
    assert la.propose([1, 2, 3, 7, 8], [], 3) == ([9, 10], GUESS_MATCH)
    assert la.propose([1, 2, 3, 7, 8, 9, 5], [], 3) == ([], GUESS_MATCH)
    # "2 3" occurred before: what followed it in the text, whatever was guessed
    tokens, match = la.propose([1, 2, 3, 7, 8, 2, 3], [4, 4], 2)
    assert tokens == [7, 8] and match >= 2


def test_the_pool_is_bounded(monkeypatch):
    monkeypatch.setattr(lookahead, "POOL_ENTRIES", 4)
    la = Lookahead()
    la.propose([1], list(range(100, 110)), 4)
    assert list(la.pool) == [105, 106, 107, 108]


@pytest.fixture(scope="module")
def demo_target() -> ModelRunner:
    return ModelRunner(RunnerConfig(str(paths.demo_target_dir()), kv_cache_mb=32))


def test_greedy_output_is_the_targets_and_the_guesses_are_kept(demo_target, monkeypatch):
    """The demo target's greedy text, drafted by lookahead at γ 4: the target's alone;
    rounds proposed the guesses it handed back (DraftItem.guesses) and kept some."""
    tokenizer = Tokenizer(paths.demo_target_dir())
    prompts = [tokenizer.encode(t) for t in ("def fibonacci(n):\n", "The history of the")]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    alone = [s.output_ids for s in SpeculativeDecoder(demo_target).generate(prompts, greedy, 0)]
    guessed: list[list[int]] = []
    propose = Lookahead.propose

    def noting(self, context, guesses, gamma, *sizes):
        out = propose(self, context, guesses, gamma, *sizes)
        if guesses and out[0] == guesses[:gamma]:
            guessed.append(out[0])
        return out
    monkeypatch.setattr(Lookahead, "propose", noting)
    mix = ProposerMix(None, demo_target.vocab_size, ProposerKind.LOOKAHEAD)
    seqs = SpeculativeDecoder(demo_target, mix).generate(prompts, greedy, 4)
    assert [s.output_ids for s in seqs] == alone
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    drafted, kept = stats.by_proposer["lookahead"]
    assert len(guessed) >= 5 and kept > 0, (guessed, stats.by_proposer)
    assert demo_target.blocks.num_used_blocks == 0 and not mix._held


@pytest.mark.parametrize("kind", [ProposerKind.LOOKAHEAD, ProposerKind.NGRAM])
def test_sampled_output_is_the_targets_own_for_its_seed(demo_target, kind):
    """T 0.7, top-p 0.9, seeded: point-mass drafts verified against the target's own
    sample there (rejection.py) emit what the target alone does for the seed, token for
    token; lookahead's guesses, drawn with the same uniforms, are kept."""
    tokenizer = Tokenizer(paths.demo_target_dir())
    prompts = [tokenizer.encode(t) for t in ("def fibonacci(n):\n", "The history of the")]
    params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, ignore_eos=True,
                             seed=seed) for seed in (11, 2**40 + 3)]
    alone = [s.output_ids for s in SpeculativeDecoder(demo_target).generate(prompts, params, 0)]
    mix = ProposerMix(None, demo_target.vocab_size, kind)
    seqs = SpeculativeDecoder(demo_target, mix).generate(prompts, params, 4)
    assert [s.output_ids for s in seqs] == alone
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    drafted, kept = stats.by_proposer[kind.value]
    assert drafted > 0 and kept > 0, stats.by_proposer


def test_the_speculative_config_and_the_proposer_flag_name_it():
    import argparse

    from outrider.cli.common import _apply_speculative_config, speculative_config

    args = argparse.Namespace(draft=None, gamma=None, proposer="auto", self_draft_layers=None,
                              speculative_config=speculative_config(
                                  '{"method": "lookahead", "num_speculative_tokens": 3}'))
    _apply_speculative_config(args)
    assert (args.proposer, args.draft, args.gamma) == ("lookahead", "", 3)
    assert ProposerKind.parse("lookahead").is_model_free
