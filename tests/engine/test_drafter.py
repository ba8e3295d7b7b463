"""The drafter's Propose contract: sync to the caller's prefix, MISS, eviction."""

from __future__ import annotations

import pytest

from outrider.core.sampling import SamplingParams
from outrider.engine.drafter import Drafter
from outrider.engine.proposer import DraftItem
from outrider.engine.runner import ModelRunner, RunnerConfig

GREEDY = SamplingParams()
CONTEXT = [5, 17, 33, 2, 41, 99, 150, 7]


def item(seq_id, committed_len, new, gamma=3):
    return DraftItem(seq_id, committed_len, new, gamma, GREEDY, seed=1)


@pytest.fixture
def drafter(draft_dir):
    return Drafter(ModelRunner(RunnerConfig(str(draft_dir), block_size=4, kv_cache_mb=0.02)),
                   evict_lru=True)


def test_incremental_sync_equals_fresh_context(drafter):
    first = drafter.draft([item("a", 0, CONTEXT[:5])])
    assert first.gammas == [3] and not first.is_miss[0]
    # the caller committed 3 more tokens; the draft's own unverified tokens are dropped
    incremental = drafter.draft([item("a", 5, CONTEXT[5:])])
    fresh = drafter.draft([item("b", 0, CONTEXT)])
    assert incremental.token_ids.tolist() == fresh.token_ids.tolist()


def test_unknown_or_short_prefix_is_a_miss(drafter):
    out = drafter.draft([item("nope", 4, [1, 2])])
    assert out.is_miss == [True] and out.gammas == [0]
    drafter.draft([item("a", 0, CONTEXT[:3], gamma=1)])  # holds 3 positions
    assert drafter.draft([item("a", 6, [9])]).is_miss == [True]
    assert drafter.num_misses == 2


def test_lru_eviction_makes_room_and_later_misses(drafter):
    total = drafter.runner.blocks.num_blocks
    seq_ids = [f"s{i}" for i in range(total)]
    for s in seq_ids:  # each sequence takes 3 of the few blocks
        drafter.draft([item(s, 0, CONTEXT + [1, 2, 3], gamma=2)])
    assert drafter.num_evicted > 0
    assert drafter.draft([item(seq_ids[0], 11, [4])]).is_miss == [True]
    latest = drafter.draft([item(seq_ids[-1], 11, [4])])
    assert latest.is_miss == [False] and latest.gammas == [3]


def test_idle_sequences_expire(drafter):
    drafter.draft([item("a", 0, CONTEXT)])
    assert drafter.evict_idle(max_idle_s=60) == 0
    assert drafter.evict_idle(max_idle_s=-1) == 1
    assert drafter.runner.blocks.num_used_blocks == 0


def test_gamma_zero_items_are_left_alone(drafter):
    out = drafter.draft([item("a", 7, [1], gamma=0), item("b", 0, CONTEXT, gamma=2)])
    assert out.gammas == [0, 2] and out.is_miss == [False, False]
    assert not drafter.runner.blocks.has("a")


def test_empty_new_tokens_are_a_miss(drafter):
    drafter.draft([item("a", 0, CONTEXT)])
    out = drafter.draft([item("a", 8, [])])
    assert out.is_miss == [True] and out.gammas == [0]


def test_no_eviction_when_it_cannot_make_room(drafter):
    drafter.draft([item("a", 0, CONTEXT)])
    too_long = [1] * (drafter.runner.blocks.num_blocks * 4 + 1)
    out = drafter.draft([item("huge", 0, too_long)])
    assert out.gammas == [0] and drafter.runner.blocks.has("a") and drafter.num_evicted == 0


def test_a_row_stops_drafting_at_a_token_that_ends_its_output(drafter):
    full = drafter.draft([item("a", 0, CONTEXT, gamma=6)]).token_ids[0].tolist()
    stop_at = next(j for j in range(1, 6) if full[j] not in full[:j])
    stops = SamplingParams(stop_token_ids=(full[stop_at],))
    out = drafter.draft([DraftItem("b", 0, CONTEXT, 6, stops, seed=1),
                         item("c", 0, CONTEXT, gamma=6)])
    assert out.gammas == [stop_at + 1, 6]   # the other row drafts its whole γ
    assert out.token_ids[0, :stop_at + 1].tolist() == full[:stop_at + 1]
    assert out.token_ids[1].tolist() == full
    # the positions reserved past the stop are given back: the KV holds the drafts but
    # the last, and the next round syncs as usual
    assert drafter.runner.blocks.seq_len("b") == len(CONTEXT) + stop_at
    again = drafter.draft([DraftItem("b", len(CONTEXT), [full[0]], 3, GREEDY, seed=1)])
    assert again.token_ids[0].tolist() == full[1:4]
