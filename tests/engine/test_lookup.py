"""Model-free proposers (outrider/engine/lookup.py) and the mix that chooses between them
and the draft model per request and per round (outrider/engine/mix.py): what they
propose, what they keep, and that greedy output is the target's own whatever proposes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outrider.core.sampling import SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.engine.drafter import Drafter
from outrider.engine.lookup import (
    HITS_PER_KEY,
    SPEC_FACTOR,
    SuffixCorpus,
    prompt_lookup,
    suffix_lookup,
)
from outrider.engine.mix import EXPLORE_EVERY, ProposerMix, _Acceptance, _Held
from outrider.engine.proposer import DraftItem
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder

CPU = torch.device("cpu")


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


# -- prompt lookup (ngram) --------------------------------------------------------------------

def test_prompt_lookup_takes_the_longest_ngram_then_the_most_recent():
    # "1 2 3" occurs at 0 (followed by 10 11) and "2 3" at 6 (followed by 20 21): the
    # longer match wins although it is older
    context = ids(1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3)
    assert prompt_lookup(context, 2).tokens == [10, 11]
    # two occurrences of the same n-gram: the most recent
    context = ids(5, 6, 7, 5, 6, 8, 5, 6)
    assert prompt_lookup(context, 3).tokens == [8, 5, 6]
    # ... unless too few tokens follow it: then the earliest, with the most after it
    context = ids(1, 2, 3, 4, 5, 9, 1, 2, 7, 1, 2)
    assert prompt_lookup(context, 4).tokens == [3, 4, 5, 9]
    assert prompt_lookup(context, 2).tokens == [7, 1]


def test_prompt_lookup_needs_min_n_and_stops_at_the_context():
    assert prompt_lookup(ids(4, 9, 9, 9, 4), 3).tokens == []          # a 1-gram match only
    assert prompt_lookup(ids(1, 2, 3, 1, 2), 8).tokens == [3, 1, 2]  # what followed, up to the end
    assert prompt_lookup(ids(1, 2, 1, 2), 0).tokens == []
    assert prompt_lookup(ids(7), 4).tokens == []


# -- suffix matching --------------------------------------------------------------------------

def test_suffix_lookup_proposes_at_most_spec_factor_times_the_match():
    # the context's suffix "8 9" (2 tokens) matches at 0: at most 4 tokens follow
    context = ids(8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert suffix_lookup(context, 16, SuffixCorpus()).tokens == [1, 2, 3, 4][:SPEC_FACTOR * 2]
    assert suffix_lookup(context, 3, SuffixCorpus()).tokens == [1, 2, 3]
    assert suffix_lookup(ids(1, 2, 3, 4), 4, SuffixCorpus()).tokens == []  # nothing repeats


def test_suffix_lookup_finds_the_longest_match_in_the_corpus():
    corpus = SuffixCorpus()
    corpus.add([50, 1, 2, 3, 4, 60, 61, 62])  # "1 2 3 4" then 60 61 62
    corpus.add([2, 3, 4, 70, 71])             # "2 3 4" then 70: a shorter match, newer
    assert suffix_lookup(ids(9, 1, 2, 3, 4), 3, corpus).tokens == [60, 61, 62]
    # the sequence's own occurrence wins a tie with the corpus
    assert suffix_lookup(ids(2, 3, 4, 80, 81, 2, 3, 4), 2, corpus).tokens == [80, 81]


def test_suffix_corpus_stays_within_its_token_budget_and_forgets_what_it_dropped():
    corpus = SuffixCorpus(max_tokens=100)
    for k in range(30):
        corpus.add([1000 + k, 1, 2, 3, 2000 + k, 5, 6, 7, 8, 9])
    assert corpus.num_tokens <= 100
    # the index holds only positions in the documents kept, at most HITS_PER_KEY per key
    kept = set(corpus._docs)
    assert all(hit >> 32 in kept for hits in corpus._index.values() for hit in hits)
    assert all(len(hits) <= HITS_PER_KEY for hits in corpus._index.values())
    assert not any(key >> 32 == 1000 for key in corpus._index)  # the first document is gone
    # the newest document answers
    assert suffix_lookup(ids(42, 1, 2, 3), 1, corpus).tokens == [2029]


# -- the mix -----------------------------------------------------------------------------------

def item(seq_id, committed_len, new, gamma, proposer="", prefill_only=False) -> DraftItem:
    return DraftItem(seq_id, committed_len, list(new), gamma,
                     SamplingParams(temperature=0.0), seed=0, proposer=proposer,
                     prefill_only=prefill_only)


def test_mix_without_a_model_looks_up_and_learns_what_was_kept():
    mix = ProposerMix(None, vocab_size=100, default=ProposerKind.NGRAM)
    context = [1, 2, 3, 4, 5, 1, 2]
    out = mix.draft([item("a", 0, context, 3)], CPU)
    assert out.gammas == [3] and out.token_ids[0].tolist() == [3, 4, 5]
    assert out.probs is None and out.source(0) == ("ngram", 3)
    # the loop kept 3 and 4 (5 was rejected: 9 came instead): the lookups' acceptance
    # estimate for this request moves toward 2 of 3 tested positions
    before = mix._held["a"].acceptance.of_lookup(2)  # "1 2" matched: 2 tokens
    out = mix.draft([item("a", len(context), [3, 4, 9], 3)], CPU)
    # tested: kept, kept, rejected; EWMA weight 0.2 for the request, 0.02 for the replica
    assert mix._held["a"].acceptance.of_lookup(2) == pytest.approx(
        ((before + 0.2 * (1 - before)) * 0.8 + 0.2) * 0.8)
    assert mix.acceptance.of_lookup(2) == pytest.approx(  # where new requests start
        ((before + 0.02 * (1 - before)) * 0.98 + 0.02) * 0.98)
    assert out.gammas == [0]  # "4 9" never occurred: nothing to propose
    # a caller that believes the mix holds more than it does gets a MISS
    assert mix.draft([item("a", 50, [1], 2)], CPU).is_miss == [True]
    assert mix.release("a") and not mix.release("a")
    assert mix.corpus.num_tokens == len(context) + 3  # the finished context was kept


def test_mix_model_requests_never_look_up_and_free_requests_never_draft(llama_dir, draft_dir):
    model = Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=16)))
    mix = ProposerMix(model, model.vocab_size, default=ProposerKind.AUTO)
    context = [5, 6, 7, 8, 5, 6, 7]
    out = mix.draft([item("m", 0, context, 4, proposer="model"),
                     item("n", 0, context, 4, proposer="ngram")], CPU)
    assert out.source(0) == ("", 0) and out.gammas[0] == 4
    assert out.source(1) == ("ngram", 4) and out.token_ids[1].tolist() == [8, 5, 6, 7]
    assert model.runner.blocks.has("m") and not model.runner.blocks.has("n")
    assert mix.is_model_free(ProposerKind.NGRAM) and not mix.is_model_free(None)


def test_auto_leads_with_a_lookup_it_trusts_and_lets_the_model_continue(draft_dir):
    model = Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=16)))
    mix = ProposerMix(model, model.vocab_size)
    context = [5, 6, 7, 8, 5, 6, 7]  # "5 6 7" matched (3 tokens): 8 5 6 7 follow
    # a request whose lookups are kept more often than the model's drafts: the lookup
    # leads and the model drafts 2 more after it, from the context + the looked-up tokens
    mix._held["c"] = _Held(acceptance=_Acceptance(free=[0.9] * 8, model=0.6))
    out = mix.draft([item("c", 0, context, 6)], CPU)
    assert out.source(0) == ("suffix", 4) and out.gammas == [6]
    assert out.token_ids[0, :4].tolist() == [8, 5, 6, 7]
    assert out.probs is None  # greedy: point masses throughout
    assert model.runner.blocks.seq_len("c") == 7 + 4 + 1  # the context, lookups, 1 draft
    # ... alone when it fills the round: no draft call
    mix._held["f"] = _Held(acceptance=_Acceptance(free=[0.9] * 8, model=0.6))
    out = mix.draft([item("f", 0, context, 4)], CPU)
    assert out.source(0) == ("suffix", 4) and out.gammas == [4]
    assert not model.runner.blocks.has("f")
    # a request whose model does better than its lookups at this match length: the model
    mix._held["m"] = _Held(acceptance=_Acceptance(free=[0.9, 0.9, 0.5] + [0.9] * 5,
                                                  model=0.8))
    out = mix.draft([item("m", 0, context, 6)], CPU)
    assert out.source(0) == ("", 0) and out.gammas == [6]
    assert mix._held["m"].shadow == [8, 5, 6, 7]  # scored against what follows, for free
    # every EXPLORE_EVERY-th round with a choice tries the model, however the lookup does
    held = mix._held["x"] = _Held(acceptance=_Acceptance(free=[0.9] * 8, model=0.1))
    held.num_weighed = EXPLORE_EVERY - 1
    assert mix.draft([item("x", 0, context, 6)], CPU).source(0) == ("", 0)


def test_the_policys_rounds_ask_their_proposer_whatever_the_requests_kind(llama_dir,
                                                                          draft_dir):
    """The γ policy's probe (docs/DESIGN.md §4.4) tests the draft model: its round's item
    names the model, so AUTO cannot serve it from a lookup; its lookup rounds name the
    suffix lookup; other rounds keep the request's kind."""
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=32))
    model = Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=16)))
    decoder = SpeculativeDecoder(target, ProposerMix(model, target.vocab_size))
    seq = decoder.new_sequence([11, 12, 13, 14] * 4, SamplingParams(max_tokens=8))
    seq.proposer = "suffix"
    assert decoder._draft_item(seq, 1).proposer == "suffix"
    seq.round_proposer = "model"
    assert decoder._draft_item(seq, 1).proposer == "model"
    seq.proposer, seq.round_proposer = "", "suffix"
    assert decoder._draft_item(seq, 1).proposer == "suffix"
    decoder.release(seq)


@pytest.mark.parametrize("kind", ["ngram", "suffix", "auto"])
@pytest.mark.parametrize("with_model", [False, True], ids=["lookups", "with-draft"])
def test_greedy_output_is_the_targets_whatever_proposes(llama_dir, draft_dir, kind, with_model):
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=32))
    model = (Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=16)))
             if with_model else None)
    prompts = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12], [3, 9, 27, 81, 3, 9, 27],
               [200, 201, 202, 203, 204]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = SpeculativeDecoder(target).generate(prompts, params, gamma=0)
    for overlap in (0, 8):
        mix = ProposerMix(model, target.vocab_size, ProposerKind(kind))
        decoder = SpeculativeDecoder(target, mix, overlap_max_seqs=overlap)
        for _ in range(2):  # the second time the suffix corpus holds the first's outputs
            seqs = decoder.generate(prompts, params, gamma=5)
            assert [s.output_ids for s in seqs] == [s.output_ids for s in alone]
        proposed = {m for s in seqs for m in s.stats.by_proposer}
        assert proposed >= {"ngram" if kind == "ngram" else "suffix"}
        assert target.blocks.num_used_blocks == 0 and not mix._held


def test_a_seeded_sample_does_not_depend_on_what_else_was_served(llama_dir, draft_dir):
    """A sampled request's lookups emit the target's own sample (point masses, DESIGN
    §3.2) and AUTO gives it the model's drafts: the same seed gives the same sample
    before and after the suffix corpus took in other requests' outputs, and whatever the
    replica's default kind."""
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=32))
    model = Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=16)))
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True,
                             logit_bias=((68, 8.0), (95, 8.0))) for i in range(8)]
    for kind, model_or_none in (("suffix", None), ("auto", model)):
        mix = ProposerMix(model_or_none, target.vocab_size, ProposerKind(kind))
        decoder = SpeculativeDecoder(target, mix)
        first = [s.output_ids for s in decoder.generate([prompt] * 8, params, gamma=4)]
        # other requests' outputs, continuing these very prompts, fill the corpus
        others = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 4
        decoder.generate([prompt] * 4, others, gamma=4)
        assert mix.corpus.num_tokens > 0
        again = decoder.generate([prompt] * 8, params, gamma=4)
        assert [s.output_ids for s in again] == first
        methods = {m for s in again for m in s.stats.by_proposer}
        assert methods == ({"suffix"} if kind == "suffix" else {"draft_model"}), methods
