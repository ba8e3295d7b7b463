"""Prefix caching: the block manager's sharing rules against a model of the KV memory,
and greedy output with the cache on equal to the output with it off."""

from __future__ import annotations

import inspect
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider import paths
from outrider.core.sampling import SamplingParams
from outrider.core.tokenizer import Tokenizer
from outrider.engine.block_manager import BlockManager
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import VOCAB, save_random_checkpoint

BLOCK = 4


class Memory:
    """What the KV slots hold: the token each position was computed for. A sequence
    reads its positions through its block table; sharing is right when every sequence
    reads its own tokens back."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks, self.slots = blocks, {}

    def write(self, seq_id, tokens: list[int], start: int) -> None:
        table = self.blocks.block_table(seq_id)
        for pos in range(start, start + len(tokens)):
            self.slots[table[pos // BLOCK] * BLOCK + pos % BLOCK] = tokens[pos - start]

    def read(self, seq_id, n: int) -> list[int]:
        table = self.blocks.block_table(seq_id)
        return [self.slots.get(table[p // BLOCK] * BLOCK + p % BLOCK) for p in range(n)]


def run_prefix(blocks: BlockManager, memory: Memory, seq_id, tokens: list[int],
               num_draft: int, num_accepted: int) -> bool:
    """What the engine does: start on the cached prefix, compute the rest and `num_draft`
    junk draft positions, keep `num_accepted` of them, seal. False: no room."""
    cached = blocks.match_prefix(seq_id, tokens)
    assert memory.read(seq_id, cached) == tokens[:cached]
    assert cached < len(tokens)  # the last token is always computed
    new = tokens[cached:] + [-1] * num_draft
    if not blocks.can_append(seq_id, len(new)):
        blocks.free(seq_id)
        return False
    blocks.append(seq_id, len(new))
    memory.write(seq_id, new, cached)
    kept = len(tokens) + min(num_accepted, num_draft)
    blocks.rollback(seq_id, kept)
    final = tokens + [-1] * (kept - len(tokens))  # accepted drafts are tokens too
    blocks.seal(seq_id, final, kept)
    assert memory.read(seq_id, kept) == final
    return True


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 23), st.integers(0, 4),
                          st.integers(0, 4), st.booleans()), min_size=1, max_size=40),
       st.integers(4, 24))
def test_every_sequence_reads_its_own_tokens(ops, num_blocks):
    """Random prompts over a few shared stems, drafts rolled back, frees and eviction
    under pressure: no sequence ever reads another prefix's KV, accounting stays exact."""
    blocks = BlockManager(num_blocks, BLOCK)
    memory = Memory(blocks)
    stems = [[s * 100 + i for i in range(24)] for s in range(4)]
    live: dict[int, list[int]] = {}
    for n, (stem, length, drafts, accepted, free_one) in enumerate(ops):
        tokens = stems[stem][:length]
        if run_prefix(blocks, memory, n, tokens, drafts, accepted):
            live[n] = tokens
        if free_one and live:
            victim = random.Random(n).choice(sorted(live))
            blocks.free(victim)
            del live[victim]
        for seq_id, t in live.items():
            assert memory.read(seq_id, len(t)) == t
        held = {b for s in live for b in blocks.block_table(s)}
        assert blocks.num_used_blocks == len(held)
    for seq_id in list(live):
        blocks.free(seq_id)
    assert blocks.num_free_blocks == num_blocks


def test_a_prefix_is_shared_and_outlives_its_sequence():
    blocks = BlockManager(16, BLOCK)
    tokens = list(range(10))
    assert blocks.match_prefix("a", tokens) == 0
    blocks.append("a", 10)
    blocks.seal("a", tokens, 10)
    assert blocks.match_prefix("b", tokens + [99]) == 8  # two full blocks
    assert blocks.block_table("b") == blocks.block_table("a")[:2]
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_free_blocks == 16 and blocks.num_cached_blocks == 2
    assert blocks.match_prefix("c", tokens) == 8
    assert blocks.num_hit_tokens == 16 and blocks.num_queried_tokens == 31


def test_a_waiting_sequence_extends_its_match_with_blocks_sealed_since():
    blocks = BlockManager(16, BLOCK)
    tokens = list(range(13))
    blocks.append("a", 4)
    blocks.seal("a", tokens, 4)
    assert blocks.match_prefix("b", tokens) == 4
    blocks.append("a", 8)
    blocks.seal("a", tokens, 12)
    assert blocks.match_prefix("b", tokens) == 12
    assert blocks.num_queried_tokens == 13 and blocks.num_hit_tokens == 12
    blocks.append("b", 1)  # its own position: it runs now
    with pytest.raises(ValueError, match="of its own"):
        blocks.match_prefix("b", tokens)


def test_the_last_token_is_never_taken_from_the_cache():
    blocks = BlockManager(16, BLOCK)
    tokens = list(range(8))
    blocks.append("a", 8)
    blocks.seal("a", tokens, 8)
    assert blocks.match_prefix("b", tokens) == 4  # 8 cached, but token 7 needs its logits


def test_one_different_token_shares_only_the_blocks_before_it():
    blocks = BlockManager(16, BLOCK)
    tokens = list(range(16))
    blocks.append("a", 16)
    blocks.seal("a", tokens, 16)
    other = tokens.copy()
    other[9] = 1000
    assert blocks.match_prefix("b", other + [0]) == 8


def test_equal_hashes_with_different_tokens_never_match():
    # CPython hashes ints modulo 2**61 - 1: these blocks' keys collide, their tokens differ
    blocks = BlockManager(16, BLOCK)
    tokens = [5, 6, 7, 8, 9]
    twin = [5 + (2**61 - 1), 6, 7, 8, 9]
    assert hash(tuple(tokens[:4])) == hash(tuple(twin[:4]))
    blocks.append("a", 5)
    blocks.seal("a", tokens, 5)
    assert blocks.match_prefix("b", twin) == 0


def test_draft_positions_are_never_sealed_and_sealed_blocks_never_roll_back():
    blocks = BlockManager(16, BLOCK)
    tokens = list(range(6))
    blocks.append("a", 6 + 4)  # 6 committed + 4 draft positions
    blocks.seal("a", tokens, 6)
    assert blocks.sealed_len("a") == 4  # the block holding drafts stays private
    with pytest.raises(ValueError, match="sealed"):
        blocks.rollback("a", 3)
    blocks.rollback("a", 6)


def test_eviction_takes_least_recently_used_deepest_blocks_first():
    blocks = BlockManager(4, BLOCK)
    tokens = list(range(13))
    blocks.append("a", 13)
    blocks.seal("a", tokens, 13)
    blocks.free("a")  # 3 sealed blocks cached, 1 empty
    blocks.append("b", 8)  # takes the empty block, then evicts the deepest cached one
    blocks.free("b")
    assert blocks.match_prefix("c", tokens) == 8


def test_turning_it_off_shares_nothing():
    blocks = BlockManager(16, BLOCK, prefix_caching=False)
    tokens = list(range(10))
    blocks.append("a", 10)
    blocks.seal("a", tokens, 10)
    assert blocks.match_prefix("b", tokens) == 0 and blocks.num_cached_blocks == 0


# -- the engine: cache on and off give the same greedy output --------------------------------

NEAR_TIE = 1e-4


def _prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """A shared 'system prompt', prompts that differ in one token, repeats, extensions."""
    stem = tokenizer.encode(inspect.getsource(json.dumps))[:150]
    prompts = [stem + tokenizer.encode(f"\n# case {i}\n") for i in range(4)]
    prompts.append(prompts[0][:77] + [prompts[0][77] + 1] + prompts[0][78:])
    prompts += [prompts[1], prompts[2] + prompts[3]]
    return prompts


@pytest.fixture(scope="module")
def pair_dirs():
    return str(paths.demo_target_dir()), str(paths.demo_draft_dir())


@pytest.mark.parametrize("kv_mb", [64, 1.5])  # 1.5 MB: evictions in every round
def test_greedy_output_is_the_same_with_the_cache_on_and_off(pair_dirs, kv_mb):
    target_dir, draft_dir = pair_dirs
    tokenizer = Tokenizer(target_dir)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)

    def run(caching: bool):
        def runner(d):
            return ModelRunner(RunnerConfig(d, kv_cache_mb=kv_mb, prefix_caching=caching))
        decoder = SpeculativeDecoder(runner(target_dir), Drafter(runner(draft_dir),
                                                                 evict_lru=True))
        out = []
        for p in _prompts(tokenizer):  # one after another: later ones find the earlier ones
            out += decoder.generate([p], params, gamma=4)
        if kv_mb > 8:  # and batched, where they fit at once
            out += decoder.generate(_prompts(tokenizer)[:3], params, gamma=4)
        return out, decoder

    cached, decoder = run(True)
    plain, _ = run(False)
    assert decoder.target.blocks.num_hit_tokens > 0
    assert decoder.drafter.runner.blocks.num_hit_tokens > 0
    assert any(s.num_cached_tokens for s in cached)
    assert not any(s.num_cached_tokens for s in plain)
    assert_same_but_for_near_ties(cached, plain)


def test_a_sliding_window_model_shares_prefixes_longer_than_its_window(tmp_path):
    model_dir = tmp_path / "mistral"
    save_random_checkpoint(model_dir, arch="mistral", sliding_window=24, head_dim=16)
    stem = [random.Random(0).randrange(VOCAB) for _ in range(70)]  # > 2 windows
    prompts = [stem + [i, i + 1] for i in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)

    def run(caching: bool):
        runner = ModelRunner(RunnerConfig(str(model_dir), kv_cache_mb=8, prefix_caching=caching))
        decoder = SpeculativeDecoder(runner)
        return [decoder.generate([p], params, gamma=0)[0] for p in prompts]

    cached, plain = run(True), run(False)
    assert [s.num_cached_tokens for s in cached] == [0, 64, 64]
    assert_same_but_for_near_ties(cached, plain)


def assert_same_but_for_near_ties(on, off) -> None:
    """Each pair of sequences is identical up to a first difference at a near-tie."""
    for a, b in zip(on, off, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids))
                      if x != y), None)
        if first is not None:
            (_, best), (_, second) = b.logprobs[first].top
            assert best - second < NEAR_TIE, (first, best, second)
