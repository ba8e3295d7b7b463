"""Must show 5: with a real draft and target, sampling with speculation gives the
target-only distribution of the generated tokens (two-sample tests), with the request's
logits processors (a grammar's mask, repetition, frequency and presence penalties,
logit_bias, min_p, top-k, top-p) applied to p and q over the same history, drafts
included.

Every request generates MAX_TOKENS tokens. The 1st comes from the prefill step, which never
speculates; rounds speculate from the 2nd on. MAX_TOKENS = 10 lets a γ = 8 round run whole
(clip_gamma keeps γ < the tokens still to come): token 1 from the prefill, tokens 2-9 the
round's drafts (accepted or recovered), token 10 its bonus. With overlap the draft drafts
round r+1 during round r and the bonus position verifies a drafted candidate.

γ = 2 drafts with the session's draft, which the target mostly rejects (the recovered
token, from the residual, carries the most mass); γ = 4 and 8 with a closer draft, whose
rounds often accept deep, so that rows late in a round, with several drafts in their
history, emit tokens (with the far draft 1-2% of rounds accept a 4th draft token and
none a 6th; with the close one 7-21% of γ = 8 rounds accept all 8).

For each sampling config × γ ∈ {2, 4, 8} × overlap off/on, the speculative samples are
compared with target-only samples (γ = 0, drawn once per config and shared) by
  - a chi-square test of the token at each of the 10 positions,
  - a chi-square test of each adjacent pair of positions (the joint distribution),
  - a chi-square test of the repeat profile: how many tokens repeat a prompt token and
    how many repeat an earlier output token (what the penalties act on).
A W8A8 copy of the target, its inputs quantized per token, is held to its own
target-only samples. The other tests show that these tests have power: the penalties
change the target-only distribution (else the penalty configs would test nothing), and
a wrong temperature, a wrong repetition penalty, or a target that leaves the round's
drafts out of a row's history are all detected at the same threshold.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

import outrider.engine.spec_decode as spec_decode_module
from outrider.core.sampling import History, SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.core.stats import MODEL_METHOD, SpecStats
from outrider.core.structured import StructuredOutput
from outrider.core.tokenizer import Tokenizer, vocab_fingerprint
from outrider.engine.cross_vocab import CrossVocabDrafter
from outrider.engine.drafter import Drafter
from outrider.engine.heads import head_proposer
from outrider.engine.layer_skip import LAYER_SKIP_METHOD, layer_skip_proposer
from outrider.engine.mix import ProposerMix
from outrider.engine.quant.weight import Int8Int8Linear
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.engine.tree import TreeShape, first_path
from tests.checkpoints import (
    permuted_vocab_copy,
    perturbed_copy,
    quantized_copy,
    save_random_head,
    save_random_medusa,
)
from tests.toolchain import needs_compiler, needs_int8_gemm

NUM_SAMPLES = 2000  # per run; all of a run's requests are one generate() batch
MAX_TOKENS = 10
# repeated tokens, so that the repetition penalty acts from the first output token
PROMPT = [7, 41, 99, 7, 41, 12, 250, 3, 99, 7]
GAMMAS = (2, 4, 8)
DRAFT_OF_GAMMA = {2: "far", 4: "close", 8: "close"}  # see the module's docstring
CONFIGS = {
    "full-vocab-penalties": dict(temperature=1.0, repetition_penalty=1.3,
                                 frequency_penalty=0.5, presence_penalty=0.3),
    # 68 pushed up so that outputs repeat it unless the penalties hold it back, a prompt
    # token up, the model's favourite first token down; with these top_k, top_p and
    # min_p each cut the vocabulary in most rows
    "truncated-penalties-bias": dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05,
                                     repetition_penalty=1.3, frequency_penalty=0.5,
                                     presence_penalty=0.3,
                                     logit_bias=((68, 5.0), (99, 2.0), (95, -3.0))),
}

# Multiple comparisons (Bonferroni): a grid test makes NUM_COMPARISONS chi-square tests
# (10 positions, 9 adjacent pairs, the repeat profile) and fails if any p-value is below
# THRESHOLD, so a correct engine fails one with probability <= FAMILY_ALPHA (as far as
# the chi-square approximation holds) over a draw of the seeds. The seeds are fixed, so
# a run is deterministic: this is the chance that the seeds chosen here would have been
# unlucky. The power tests must reach the same THRESHOLD: what they detect, the grid
# would detect.
FAMILY_ALPHA = 1e-3
NUM_COMPARISONS = MAX_TOKENS + (MAX_TOKENS - 1) + 1
THRESHOLD = FAMILY_ALPHA / NUM_COMPARISONS  # 5e-5

ALL = 1 << 30  # draft ahead however big the batch
HEAD_GAMMA = 3
PAIR_CLASSES = 16  # the pair tests tell apart each position's 16 likeliest tokens

Sample = list[tuple[int, ...]]  # one tuple of MAX_TOKENS output ids per request


def two_sample_pvalue(a: list, b: list, min_count: int = 10) -> float:
    """Chi-square test of homogeneity; categories rarer than `min_count` are pooled."""
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    rare = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] < min_count]
    table = np.array([[ca[k] for k in keys] + [sum(ca[k] for k in rare)],
                      [cb[k] for k in keys] + [sum(cb[k] for k in rare)]])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return chi2_contingency(table).pvalue


def pair_classes(a: Sample, b: Sample, k: int) -> tuple[list, list]:
    """The tokens at positions k and k+1 of each request, where a token outside its
    position's PAIR_CLASSES most common (in a and b together) becomes -1: over a full
    vocabulary nearly every exact pair is rarer than `min_count`, and pooling them all
    would leave nothing to compare."""
    kept = [{t for t, _ in Counter(s[j] for s in a + b).most_common(PAIR_CLASSES)}
            for j in (k, k + 1)]

    def classes(s: tuple[int, ...]) -> tuple[int, int]:
        return (s[k] if s[k] in kept[0] else -1, s[k + 1] if s[k + 1] in kept[1] else -1)

    return [classes(s) for s in a], [classes(s) for s in b]


def repeat_profile(tokens: tuple[int, ...]) -> tuple[int, int]:
    """(tokens that are in the prompt, tokens that repeat an earlier output token)."""
    return (sum(t in PROMPT for t in tokens),
            sum(t in tokens[:k] for k, t in enumerate(tokens)))


def comparisons(a: Sample, b: Sample) -> dict[str, float]:
    """The NUM_COMPARISONS p-values, by name (positions count from 1)."""
    pvalues = {f"position {k + 1}": two_sample_pvalue([t[k] for t in a], [t[k] for t in b])
               for k in range(MAX_TOKENS)}
    for k in range(MAX_TOKENS - 1):
        pvalues[f"positions {k + 1}-{k + 2}"] = two_sample_pvalue(*pair_classes(a, b, k))
    pvalues["repeat profile"] = two_sample_pvalue([repeat_profile(t) for t in a],
                                                  [repeat_profile(t) for t in b])
    assert len(pvalues) == NUM_COMPARISONS
    return pvalues


# -- samples --------------------------------------------------------------------------------

def make_decoder(target: ModelRunner, draft_dir, overlap: bool,
                 compile: bool = False) -> SpeculativeDecoder:
    """overlap: every sampled sequence drafts the next round during this one."""
    draft = ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=64, compile=compile))
    return SpeculativeDecoder(target, Drafter(draft), overlap_max_seqs=ALL if overlap else 0,
                              overlap_sampled=overlap)


def seed_base(*run) -> int:
    """Each run its own block of 2^20 (> NUM_SAMPLES) seeds, fixed by what the run is, so
    a run draws the same seeds whichever tests run and in which order."""
    return zlib.crc32(repr(run).encode()) << 20


def generate(decoder: SpeculativeDecoder, gamma: int, first_seed: int, **sampling) -> Sample:
    params = [SamplingParams(max_tokens=MAX_TOKENS, seed=first_seed + i, ignore_eos=True,
                             **sampling) for i in range(NUM_SAMPLES)]
    seqs = decoder.generate([PROMPT] * NUM_SAMPLES, params, gamma=gamma)
    assert all(len(s.output_ids) == MAX_TOKENS for s in seqs)
    # every finished sequence gave its KV blocks back, on the target and on the draft
    assert decoder.target.blocks.num_used_blocks == 0
    assert decoder.drafter.runner.blocks.num_used_blocks == 0
    if gamma:  # the first speculative round of every request drafted γ tokens, and rounds
        # accepted drafts at every depth (the rows deep in a round emitted tokens) and
        # rejected some (the recovered tokens)
        stats = SpecStats()
        for s in seqs:
            stats.merge(s.stats)
        assert stats.drafted_per_position[gamma - 1] >= NUM_SAMPLES
        assert min(stats.accepted_per_position[:gamma]) >= NUM_SAMPLES // 100, stats
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    return [tuple(s.output_ids) for s in seqs]


class Samples:
    """Runs, cached for the module: the target-only reference of a config is drawn once
    and shared by every γ and overlap; a speculative run is drawn once and shared by the
    grid and the power tests."""

    def __init__(self, llama_dir, draft_dirs: dict) -> None:
        # one target, its KV cache empty between runs, under every decoder
        target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=64))
        self.decoders = {(draft, overlap): make_decoder(target, draft_dir, overlap)
                         for draft, draft_dir in draft_dirs.items() for overlap in (False, True)}
        self._runs: dict[tuple, Sample] = {}

    def decoder(self, gamma: int, overlap: bool) -> SpeculativeDecoder:
        return self.decoders[DRAFT_OF_GAMMA[gamma], overlap]

    def target_only(self, config: str, **changes) -> Sample:
        return self.target_only_with({**CONFIGS[config], **changes})

    def target_only_with(self, sampling: dict) -> Sample:
        """Target-only samples of these sampling options (drawn once)."""
        key = ("target-only", tuple(sorted(sampling.items())))
        if key not in self._runs:
            self._runs[key] = generate(self.decoders["far", False], 0, seed_base(*key),
                                       **sampling)
        return self._runs[key]

    def speculative(self, config: str, gamma: int, overlap: bool) -> Sample:
        key = ("speculative", config, gamma, overlap)
        if key not in self._runs:
            decoder = self.decoder(gamma, overlap)
            candidates, ahead = decoder.num_candidates, decoder.num_ahead_rounds
            self._runs[key] = generate(decoder, gamma, seed_base(*key), **CONFIGS[config])
            # with overlap the bonus positions verified drafted candidates and, where
            # accepting one left tokens to generate, the next round used the drafts made
            # during this one (a γ = 8 round that accepts all ends its request); without
            # overlap, neither happened
            new_candidates = decoder.num_candidates - candidates
            assert (new_candidates > NUM_SAMPLES) == overlap, new_candidates
            assert (decoder.num_ahead_rounds > ahead) == (overlap and gamma < 8)
        return self._runs[key]


@pytest.fixture(scope="module")
def close_draft_dir(tmp_path_factory, llama_dir):
    """A draft nearer the target than the session's: rounds often accept 4-8 drafts."""
    return perturbed_copy(llama_dir, tmp_path_factory.mktemp("close_draft"), noise=0.03)


@pytest.fixture(scope="module")
def samples(llama_dir, draft_dir, close_draft_dir) -> Samples:
    return Samples(llama_dir, {"far": draft_dir, "close": close_draft_dir})


def failures(pvalues: dict[str, float]) -> dict[str, float]:
    return {name: p for name, p in pvalues.items() if p < THRESHOLD}


# -- the grid -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("gamma", GAMMAS, ids=[f"gamma{g}" for g in GAMMAS])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_speculative_sampling_matches_target_distribution(samples, config, gamma, overlap):
    pvalues = comparisons(samples.speculative(config, gamma, overlap),
                          samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)


@needs_compiler
@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold compile (tests/engine/test_compiled.py's note)
def test_compiled_speculative_sampling_matches_target_distribution(samples, llama_dir,
                                                                   close_draft_dir):
    """The grid's γ = 4 case with the target and the draft compiled (--compile), against
    the eager target alone."""
    config = "truncated-penalties-bias"
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=64, compile=True))
    decoder = make_decoder(target, close_draft_dir, overlap=False, compile=True)
    sample = generate(decoder, 4, seed_base("speculative-compiled", config, 4),
                      **CONFIGS[config])
    assert target.step.is_compiled and decoder.drafter.runner.step.is_compiled
    pvalues = comparisons(sample, samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)


@needs_int8_gemm
@pytest.mark.slow
def test_quantized_target_speculative_sampling_matches_its_distribution(close_draft_dir,
                                                                       llama_dir, tmp_path):
    """The grid's γ = 4 case over a W8A8 copy of the target (its inputs quantized per token,
    the int8 GEMM: quantized compute in fp32 too), the unquantized close draft proposing,
    against the quantized target alone."""
    config = "truncated-penalties-bias"
    quantized = quantized_copy(llama_dir, tmp_path / "w8a8", "W8A8")
    target = ModelRunner(RunnerConfig(str(quantized), kv_cache_mb=64))
    assert {type(m.quantized_matmul) for m in target.model.modules()
            if getattr(m, "quantized_bits", 0)} == {Int8Int8Linear}
    decoder = make_decoder(target, close_draft_dir, overlap=False)
    alone = generate(decoder, 0, seed_base("quantized-target-only", config), **CONFIGS[config])
    sample = generate(decoder, 4, seed_base("quantized-speculative", config), **CONFIGS[config])
    pvalues = comparisons(sample, alone)
    assert not failures(pvalues), failures(pvalues)


@pytest.mark.slow
def test_cache_aware_speculative_sampling_matches_target_distribution(samples, close_draft_dir):
    """Cache-aware drafting (the speculation cache's, Drafter._cache_aware) samples drafts
    from a q whose four likeliest tokens keep a share of their mass: verified with that q,
    the output is the target's. The grid's γ = 4 case, the share 0.3, every row shaped."""
    config = "truncated-penalties-bias"
    decoder = make_decoder(samples.decoders["close", False].target, close_draft_dir, False)
    drafter = decoder.drafter
    drafter.runners_up, drafter.aware_weight, drafter.aware_of = 3, 0.3, lambda item: True
    sample = generate(decoder, 4, seed_base("speculative-cache-aware", config, 4),
                      **CONFIGS[config])
    pvalues = comparisons(sample, samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)



# requests at a time, and the replica's stand-ins a Propose (16 by default, for about 8
# sequences a Propose): two a request, as a replica serving 8 has; 4x the default's
# requests a step, a quarter of the steps
CACHE_CHUNK, CACHE_ROWS = 32, 64


@pytest.mark.slow
def test_cached_speculative_sampling_matches_target_distribution(samples, close_draft_dir):
    """A draft replica with its speculation cache on and cache-aware (DESIGN §2.6), over
    gRPC: a sampled row's Propose takes the drafts the replica prepared for its outcome
    while the target verified (a hit) or drafts afresh (a miss, forced wherever the target
    drew a token no stand-in guessed), both many times in one run, and the output is the
    target's. The grid's γ = 4 case, CACHE_CHUNK requests at a time."""
    from outrider.draft_worker.main import DraftWorkerConfig, start
    from outrider.target_worker.remote_drafter import RemoteDrafter

    config, token = "truncated-penalties-bias", "chi2-cache"
    running = start(DraftWorkerConfig(str(close_draft_dir), kv_cache_mb=64,
                                      speculation_cache=True, cache_aware_sampling=0.5), token)
    running.service.cache.max_rows = CACHE_ROWS
    remote = RemoteDrafter([running.address], token, "t0-")
    try:
        decoder = SpeculativeDecoder(samples.decoders["close", False].target, remote)
        decoder.cache_misses.prepares = lambda: True  # (a cache hit this rarely is gated)
        first_seed = seed_base("speculative-cached", config, 4)
        sample: Sample = []
        for begin in range(0, NUM_SAMPLES, CACHE_CHUNK):
            params = [SamplingParams(max_tokens=MAX_TOKENS, seed=first_seed + i,
                                     ignore_eos=True, **CONFIGS[config])
                      for i in range(begin, begin + CACHE_CHUNK)]
            sample += [tuple(s.output_ids)
                       for s in decoder.generate([PROMPT] * CACHE_CHUNK, params, gamma=4)]
        cache = running.service.cache
        hits, misses = cache.hits, cache.misses
    finally:
        remote.close()
        running.stop(0)
    # (a hit needs the replica's preparing to end before the next Propose: 464 of 4,584
    # lookups on a quiet machine; the bound leaves a loaded one room)
    assert hits >= NUM_SAMPLES // 40 and misses >= NUM_SAMPLES // 10, (hits, misses)
    pvalues = comparisons(sample, samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)

# -- model-free proposers (outrider/engine/lookup.py, mix.py) -------------------------------

LOOKUP_GAMMA = 6
# two tokens biased up so that outputs repeat themselves (the session's random target
# rarely repeats a 2-gram by itself) and n-gram lookups find matches that verification
# both keeps and rejects; truncation and a history penalty act on p and the residual
LOOKUP_CONFIG = dict(temperature=1.0, top_p=0.95, presence_penalty=0.2,
                     logit_bias=((68, 8.0), (95, 8.0)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "suffix", "lookahead"])
def test_lookup_speculative_sampling_matches_target_distribution(samples, kind):
    """Looked-up proposals are point masses (q one-hot), verified against the target's own
    sample at the position (kept with probability p(x), DESIGN §3.2). AUTO gives sampled
    requests the model's drafts, so only these kinds propose point masses to sampled
    requests; lookahead's are the target's own draws where it verified past the committed
    tokens (DraftItem.guesses, with the uniforms the target samples those positions
    with), its pool of them, or the n-gram lookup. With overlap, truncation, a penalty and
    a bias (LOOKUP_CONFIG)."""
    target = samples.decoders["far", False].target
    mix = ProposerMix(None, target.vocab_size, ProposerKind(kind))
    decoder = SpeculativeDecoder(target, mix, overlap_max_seqs=ALL, overlap_sampled=True)
    params = [SamplingParams(max_tokens=MAX_TOKENS, seed=seed_base("lookup", kind) + i,
                             ignore_eos=True, **LOOKUP_CONFIG) for i in range(NUM_SAMPLES)]
    seqs = decoder.generate([PROMPT] * NUM_SAMPLES, params, gamma=LOOKUP_GAMMA)
    assert target.blocks.num_used_blocks == 0 and not mix._held
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    looked_up = stats.by_proposer[kind]
    # the lookups proposed often, and verification both kept and rejected their tokens
    assert looked_up[0] >= NUM_SAMPLES and 0 < looked_up[1] < looked_up[0], stats.by_proposer
    reference = samples.target_only_with(LOOKUP_CONFIG)
    pvalues = comparisons([tuple(s.output_ids) for s in seqs], reference)
    assert not failures(pvalues), failures(pvalues)


MIXED_KINDS = (ProposerKind.MODEL, ProposerKind.NGRAM, ProposerKind.SUFFIX,
               ProposerKind.LOOKAHEAD)


@pytest.mark.slow
def test_mixed_speculative_sampling_matches_target_distribution(samples, close_draft_dir):
    """One batch whose requests each name their proposer (the draft model, n-gram,
    suffix, lookahead in turn), the model's rows drafting ahead beside the others'
    lookups: each request's rounds are drafted by its own kind alone, verification keeps
    and rejects every kind's tokens, and the batch's output is the target's."""
    target = samples.decoders["far", False].target
    mix = ProposerMix(Drafter(ModelRunner(RunnerConfig(str(close_draft_dir), kv_cache_mb=64))),
                      target.vocab_size, ProposerKind.AUTO)
    decoder = SpeculativeDecoder(target, mix, overlap_max_seqs=ALL, overlap_sampled=True)
    seqs = [decoder.new_sequence(PROMPT, SamplingParams(
        max_tokens=MAX_TOKENS, seed=seed_base("mixed") + i, ignore_eos=True, **LOOKUP_CONFIG))
        for i in range(NUM_SAMPLES)]
    for i, seq in enumerate(seqs):
        seq.proposer = MIXED_KINDS[i % len(MIXED_KINDS)].value
    running = list(seqs)
    while running:
        decoder.step(running, [LOOKUP_GAMMA] * len(running))
        running = [s for s in running if not s.is_finished]
    assert target.blocks.num_used_blocks == 0 and not mix._held
    for k, kind in enumerate(MIXED_KINDS):
        stats = SpecStats()
        for seq in seqs[k::len(MIXED_KINDS)]:
            stats.merge(seq.stats)
        method = MODEL_METHOD if kind is ProposerKind.MODEL else kind.value
        assert set(stats.by_proposer) == {method}, (kind, stats.by_proposer)
        drafted, kept = stats.by_proposer[method]
        assert 0 < kept < drafted, (kind, stats.by_proposer)
    pvalues = comparisons([tuple(s.output_ids) for s in seqs],
                          samples.target_only_with(LOOKUP_CONFIG))
    assert not failures(pvalues), failures(pvalues)


# letters and spaces only: the grammar masks p at every verification row and the draft's
# q at every drafted position, after the round's drafts before it (docs/DESIGN.md §3.8)
CONSTRAINED_CONFIG = dict(temperature=1.0, presence_penalty=0.2,
                          structured_output=StructuredOutput("regex", "[a-z ]+"))


@pytest.mark.slow
def test_constrained_speculative_sampling_matches_target_distribution(samples, llama_dir):
    """With overlap (the bonus position verifies a drafted candidate under the mask
    after the round's drafts), a history penalty, and EOS ignored (after EOS a complete
    grammar allows only EOS)."""
    decoder = samples.decoder(4, True)
    constrained = generate(decoder, 4, seed_base("constrained"), **CONSTRAINED_CONFIG)
    tokenizer = Tokenizer(llama_dir)
    outside = [t for t in (tokenizer.decode(list(s)) for s in constrained)
               if not re.fullmatch("[a-z ]*", t)]  # EOS may come (the regex may end)
    assert not outside, outside[:5]
    reference = samples.target_only_with(CONSTRAINED_CONFIG)
    pvalues = comparisons(constrained, reference)
    assert not failures(pvalues), failures(pvalues)
    # the mask changes the distribution: without it the test would compare nothing new
    unconstrained = samples.target_only_with(
        {k: v for k, v in CONSTRAINED_CONFIG.items() if k != "structured_output"})
    assert len(failures(comparisons(reference, unconstrained))) >= MAX_TOKENS


# -- power ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_penalties_change_the_target_distribution(samples, config):
    """Without this the penalty configs could pass the grid by having no effect: the
    target-only samples with and without the penalties differ, in the repeat profile."""
    without = samples.target_only(config, repetition_penalty=1.0, frequency_penalty=0.0,
                                  presence_penalty=0.0)
    pvalues = comparisons(samples.target_only(config), without)
    assert pvalues["repeat profile"] < THRESHOLD, pvalues
    if config == "truncated-penalties-bias":  # here they move every later token too
        assert all(pvalues[f"position {k}"] < THRESHOLD for k in range(4, MAX_TOKENS + 1)), \
            pvalues


@pytest.mark.slow
def test_detects_a_wrong_temperature(samples):
    """Speculative samples against target-only ones at another temperature: the first
    speculative token (position 2) tells them apart."""
    config = "full-vocab-penalties"
    pvalues = comparisons(samples.speculative(config, 4, overlap=True),
                          samples.target_only(config, temperature=0.8))
    assert pvalues["position 2"] < THRESHOLD, pvalues
    assert pvalues["positions 2-3"] < THRESHOLD, pvalues


@pytest.mark.slow
def test_detects_a_wrong_repetition_penalty(samples):
    """Speculative samples against target-only ones without the repetition penalty:
    detected late, at each of positions 7-9 and 7-10 pairwise, and in the repeats."""
    config = "truncated-penalties-bias"
    pvalues = comparisons(samples.speculative(config, 4, overlap=True),
                          samples.target_only(config, repetition_penalty=1.0))
    late = ["position 7", "position 8", "position 9",
            "positions 7-8", "positions 8-9", "positions 9-10", "repeat profile"]
    assert all(pvalues[name] < THRESHOLD for name in late), pvalues


@pytest.mark.slow
def test_detects_a_target_that_forgets_the_rounds_drafts(samples, monkeypatch):
    """The bug the shared history guards against: the target penalising row j over the
    committed tokens only, without the round's drafts 0..j-1 (the draft still includes
    them). Then a draft token may repeat the one before it more often than the target
    allows; the grid's tests must see that."""
    rows_with_drafts = 0

    def without_drafts(token_ids, prompt_len, drafted=(), allowed=None):
        nonlocal rows_with_drafts
        rows_with_drafts += bool(drafted)
        return History(token_ids, prompt_len, allowed=allowed)

    monkeypatch.setattr(spec_decode_module, "History", without_drafts)
    config = "truncated-penalties-bias"
    buggy = generate(samples.decoder(4, overlap=False), 4, seed_base("forgets drafts", config),
                     **CONFIGS[config])
    assert rows_with_drafts > NUM_SAMPLES  # the patch reached the verification rows
    assert failures(comparisons(buggy, samples.target_only(config)))


# -- draft heads (outrider/engine/heads.py) --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind, tree", [("eagle3", None), ("medusa", None),
                                        ("medusa", TreeShape(3, 8))], ids=str)
def test_head_speculative_sampling_matches_target_distribution(samples, llama_dir, tmp_path,
                                                               kind, tree):
    """An EAGLE-3 head over a draft vocabulary of half the target's (q is 0 off it, d2t),
    drafting from the target's hidden states and then its own; Medusa's heads, each
    drafting from the last committed position's state, in chains and in trees (3 children
    a node drawn from head j's q without replacement, penalties over each node's own
    path): exact in distribution. Their weights are the target's where a head has them
    (lm_head rows, the final norm), so that they propose tokens the target often keeps."""
    config = "full-vocab-penalties"
    target = samples.decoders["far", False].target
    head_dir = (target_like_medusa(save_random_medusa(tmp_path / "head", llama_dir), llama_dir)
                if kind == "medusa" else
                target_like_head(save_random_head(tmp_path / "head", llama_dir,
                                                  draft_vocab=160, aux_layers=(2,),
                                                  scale=0.02), llama_dir))
    decoder = SpeculativeDecoder(target, head_proposer(
        RunnerConfig(str(head_dir), kv_cache_mb=64), target), tree=tree, choose_trees=False)
    paths = []
    if tree is not None:
        walk_trees = decoder._walk_trees

        def noted(step, ready, *args):
            walk_trees(step, ready, *args)
            paths.extend(r.path for r in ready if r.path)
        decoder._walk_trees = noted
    seqs, stats = sampled_run(decoder, HEAD_GAMMA, config, "head", kind,
                              *([str(tree)] if tree else []))
    if tree is not None:  # verification kept branches past the first child
        assert any(n > d for path in paths for d, n in enumerate(path))
    # the head drafted every round, and verification kept some of it at every depth
    assert stats.drafted_per_position[HEAD_GAMMA - 1] >= NUM_SAMPLES
    # (a head made of the target's own rows is no draft model: its third drafts are kept
    # less often, ~1 % of rounds)
    assert min(stats.accepted_per_position[:HEAD_GAMMA]) >= NUM_SAMPLES // 200, stats
    pvalues = comparisons([tuple(s.output_ids) for s in seqs], samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)


# -- self-speculation (outrider/engine/layer_skip.py) ---------------------------------------

@pytest.mark.slow
def test_layer_skip_speculative_sampling_matches_target_distribution(samples):
    """The target's first layer alone drafts (its q the skip path's, penalties applied),
    drafting ahead beside the verification that runs the same modules: exact."""
    target = samples.decoders["far", False].target
    decoder = SpeculativeDecoder(target, layer_skip_proposer(RunnerConfig(
        target.cfg.model_dir), target, "0"), overlap_max_seqs=ALL, overlap_sampled=True)
    config = "full-vocab-penalties"
    seqs, stats = sampled_run(decoder, HEAD_GAMMA, config, "layer-skip")
    assert decoder.drafter.runner.blocks.num_used_blocks == 0
    assert stats.drafted_per_position[HEAD_GAMMA - 1] >= NUM_SAMPLES
    assert min(stats.accepted_per_position[:HEAD_GAMMA]) >= NUM_SAMPLES // 100, stats
    assert set(stats.by_proposer) == {LAYER_SKIP_METHOD}, stats.by_proposer
    pvalues = comparisons([tuple(s.output_ids) for s in seqs], samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)


# -- drafts of another vocabulary (outrider/engine/cross_vocab.py) --------------------------

@pytest.mark.slow
def test_cross_vocab_speculative_sampling_matches_target_distribution(samples, close_draft_dir,
                                                                      tmp_path_factory):
    """The close draft over shuffled ids, its own tokenizer.json, on a draft replica started
    for the target (--target-model), proposes through text: its context the committed text
    re-encoded, a sampled row drawn from the tokens the target has too (each one target
    token), its q moved over to the target's ids and sent over gRPC; truncation, penalties
    and a bias act on p alone (the draft reads none). Exact. (In process the same
    CrossVocabDrafter proposes, without the wire.)"""
    from outrider.draft_worker.main import DraftWorkerConfig, start
    from outrider.target_worker.remote_drafter import RemoteDrafter

    config, token = "truncated-penalties-bias", "chi2-cross-vocab"
    target = samples.decoders["far", False].target
    draft_dir = permuted_vocab_copy(close_draft_dir, tmp_path_factory.mktemp("cross_vocab"))
    target_dir = str(target.cfg.model_dir)
    running = start(DraftWorkerConfig(str(draft_dir), kv_cache_mb=64,
                                      target_models=(target_dir,)), token)
    remote = RemoteDrafter([running.address], token, "t0-",
                           target_vocab=vocab_fingerprint(target_dir))
    try:
        assert isinstance(running.service.proposers[vocab_fingerprint(target_dir)],
                          CrossVocabDrafter)
        seqs, stats = sampled_run(SpeculativeDecoder(target, remote), 4, config, "cross-vocab")
    finally:
        remote.close()
        running.stop(0)
    assert min(stats.accepted_per_position[:4]) >= NUM_SAMPLES // 100, stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    pvalues = comparisons([tuple(s.output_ids) for s in seqs], samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)


def sampled_run(decoder: SpeculativeDecoder, gamma: int, config: str, *run
                ) -> tuple[list, SpecStats]:
    """NUM_SAMPLES requests of PROMPT under CONFIGS[config] in one batch, seeded by what
    the run is (`run`); every KV block back. Returns the sequences and their statistics."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, seed=seed_base(*run, config) + i,
                             ignore_eos=True, **CONFIGS[config]) for i in range(NUM_SAMPLES)]
    seqs = decoder.generate([PROMPT] * NUM_SAMPLES, params, gamma=gamma)
    assert decoder.target.blocks.num_used_blocks == 0
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    return seqs, stats


def target_like_head(head_dir, llama_dir):
    """The head with fc = identity over the target's last hidden state (layer id L), and
    the target's final norm and lm_head rows: its first draft is a sample of the target's
    distribution one position back, which the target often keeps."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(head_dir / "model.safetensors"))
    target = load_file(str(next(llama_dir.glob("*.safetensors"))))
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    tensors["fc.weight"] = torch.eye(tensors["fc.weight"].shape[0])
    tensors["norm.weight"] = target["model.norm.weight"].clone()
    tensors["lm_head.weight"] = target["lm_head.weight"][ids].clone()
    save_file(tensors, str(head_dir / "model.safetensors"))
    return head_dir


def target_like_medusa(head_dir, llama_dir):
    """Medusa heads whose blocks add nothing and whose lm_heads are the target's: each
    proposes a sample of the target's distribution at the last committed position."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(head_dir / "model.safetensors"))
    target = load_file(str(next(llama_dir.glob("*.safetensors"))))
    for name in tensors:
        tensors[name] = (target["lm_head.weight"].clone() if name.startswith("lm_heads.")
                         else torch.zeros_like(tensors[name]))
    save_file(tensors, str(head_dir / "model.safetensors"))
    return head_dir


# -- token trees (outrider/engine/tree.py) --------------------------------------------------

TREE_GAMMA = 4


@pytest.mark.slow
def test_tree_speculative_sampling_matches_target_distribution(samples, close_draft_dir):
    """Trees drafted by the close draft (3 children per node drawn from q without
    replacement, the 10 best nodes, 4 deep), truncation, penalties over each node's own
    path and a bias: recursive rejection sampling keeps branches past the first child and
    is exact in distribution."""
    config = "truncated-penalties-bias"
    target = samples.decoders["far", False].target
    draft = Drafter(ModelRunner(RunnerConfig(str(close_draft_dir), kv_cache_mb=64)))
    decoder = SpeculativeDecoder(target, draft, tree=TreeShape(3, 10))
    off_chain = []  # kept paths that leave the first children: a branch a chain lacks
    walk_trees = decoder._walk_trees

    def noted(step, ready, *args):
        walk_trees(step, ready, *args)
        off_chain.extend(r.path for r in ready if r.path and r.parents
                         and r.path != first_path(r.parents)[:len(r.path)])
    decoder._walk_trees = noted
    seqs, stats = sampled_run(decoder, TREE_GAMMA, config, "tree")
    assert len(off_chain) >= NUM_SAMPLES // 20, len(off_chain)
    assert min(stats.accepted_per_position[:TREE_GAMMA]) >= NUM_SAMPLES // 20, stats
    pvalues = comparisons([tuple(s.output_ids) for s in seqs], samples.target_only(config))
    assert not failures(pvalues), failures(pvalues)
