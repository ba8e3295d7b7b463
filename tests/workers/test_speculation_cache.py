"""The draft replica's speculation cache (draft_worker/spec_cache.py) on a real Drafter: a
hit answers what drafting the outcome's context afresh answers, and leaves the sequence
as drafting would; misses, releases, interruptions and a full KV cost drafts, never a
wrong one; two targets' sequences keep their stand-ins apart."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from outrider.draft_worker.spec_cache import SpeculationCache

from outrider import paths
from outrider.core.sampling import SamplingParams
from outrider.engine.drafter import Drafter
from outrider.engine.goodput import GATE_AFTER, CacheMissChoice
from outrider.engine.proposer import DraftItem
from outrider.engine.runner import ModelRunner, RunnerConfig

CONTEXT = list(range(5, 60))
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)


def drafter(draft_dir, **cfg) -> Drafter:
    return Drafter(ModelRunner(RunnerConfig(str(draft_dir), dtype="float32", **cfg)),
                   evict_lru=True)


def first_round(cache: SpeculationCache, seq_id: str, params=GREEDY, gamma: int = 4):
    """Propose for a new sequence, then draft its stand-ins: (the item, its drafts)."""
    item = DraftItem(seq_id, 0, list(CONTEXT), gamma, params, 7, "dense")
    drafts = cache.drafter.draft([item]).token_ids[0].tolist()
    cache.fill(cache.plan([item], [drafts]))
    return item, drafts


def next_item(cache: SpeculationCache, seq_id: str, drafts: list[int],
              outcome: tuple[int, ...], params=GREEDY, gamma: int = 4) -> DraftItem:
    """The Propose the target sends after committing `outcome` to the round that proposed
    `drafts`: the kept drafts counted as held (the draft's KV has all but the last), the
    rest as new tokens."""
    base = len(cache.drafter.token_ids[seq_id]) - (len(drafts) - 1)  # committed before
    kept = 0
    while kept < min(len(outcome) - 1, len(drafts) - 1) and outcome[kept] == drafts[kept]:
        kept += 1
    return DraftItem(seq_id, base + kept, list(outcome[kept:]), gamma, params, 7, "dense")


def round_then_unguessed(cache: SpeculationCache) -> tuple[list[int], int]:
    """A first round for sequence "s": its drafts, and a token no stand-in guessed for k = 0."""
    _, drafts = first_round(cache, "s")
    guessed = {o[-1] for o in cache._entries["s"][1] if len(o) == 1}
    return drafts, next(t for t in range(100, 200) if t not in guessed and t != drafts[0])


@pytest.mark.parametrize("params, weight", [(GREEDY, 1.0), (SAMPLED, 1.0), (SAMPLED, 0.5)],
                         ids=["greedy", "sampled", "cache-aware"])
def test_a_hit_answers_what_drafting_that_context_answers(draft_dir, params, weight):
    cache = SpeculationCache(drafter(draft_dir), sampled_weight=weight)
    fresh = SpeculationCache(drafter(draft_dir), sampled_weight=weight).drafter  # (shaped q)
    _, drafts = first_round(cache, "s", params)
    outcomes = list(cache._entries["s"][1])
    assert (*drafts, outcomes[0][-1]) in outcomes or any(len(o) == 5 for o in outcomes)
    assert any(len(o) < len(drafts) for o in outcomes)  # rejections too
    for outcome in (max(outcomes, key=len), min(outcomes, key=len)):  # all kept; k = 0
        cache = SpeculationCache(drafter(draft_dir), sampled_weight=weight)
        _, drafts = first_round(cache, "s", params)
        [entry] = cache.take([next_item(cache, "s", drafts, outcome, params)])
        assert entry is not None and cache.hits == 1
        want = fresh.draft([DraftItem("r", 0, CONTEXT + list(outcome), 4, params, 7, "dense")])
        assert entry.drafts == want.token_ids[0].tolist()
        if params.is_greedy:
            assert entry.q is None
        else:
            torch.testing.assert_close(entry.q, want.probs[0], atol=1e-5, rtol=1e-4)
        # the round after goes on from the stand-in's state as from drafting's
        after = next_item(cache, "s", entry.drafts, (*entry.drafts[:2], 11), params)
        got = cache.drafter.draft([after]).token_ids[0].tolist()
        after.seq_id = "r"
        assert got == fresh.draft([after]).token_ids[0].tolist()
        fresh.release("r")
        assert cache.drafter.runner.blocks.num_sequences == 1  # no stand-in left behind


def test_cache_aware_q_moves_mass_off_the_likeliest_tokens(draft_dir):
    """Its four likeliest tokens keep the weight's share of their mass, the rest grows in
    proportion; greedy rows and rows the cache does not prepare keep their q."""
    plain = SpeculationCache(drafter(draft_dir), sampled_weight=1.0).drafter
    aware = SpeculationCache(drafter(draft_dir), sampled_weight=0.25).drafter
    items = [DraftItem(s, 0, list(CONTEXT), 3, SAMPLED, 7, f) for s, f in
             (("s", "dense"), ("p", "point_mass"))]
    q, shaped = (d.draft([replace(it) for it in items]).probs[:, 0] for d in (plain, aware))
    top = q[0].topk(4).indices  # [4]
    assert shaped[0].sum().item() == pytest.approx(1.0, abs=1e-5)
    mass = q[0][top].sum()
    assert mass < 0.9  # (else the rest had nothing to take)
    torch.testing.assert_close(shaped[0][top], q[0][top] * 0.25 / (1 - 0.75 * mass))
    torch.testing.assert_close(shaped[1], q[1])  # a point mass is its argmax's


def test_sampled_rows_are_not_cached_unless_asked(draft_dir):
    cache = SpeculationCache(drafter(draft_dir))
    first_round(cache, "s", SAMPLED)
    assert "s" not in cache._entries and cache.drafter.runner.blocks.num_sequences == 1


def test_an_outcome_nobody_guessed_is_a_miss_and_drafts_as_before(draft_dir):
    looked_up = []
    cache = SpeculationCache(drafter(draft_dir), on_lookup=lambda k, hit: looked_up.append(
        (k, hit)))
    fresh = drafter(draft_dir)
    drafts, unguessed = round_then_unguessed(cache)
    item = next_item(cache, "s", drafts, (unguessed,))
    assert cache.take([item]) == [None] and cache.misses == 1 and looked_up == [(0, False)]
    assert cache.drafter.runner.blocks.num_sequences == 1  # its stand-ins are gone
    got = cache.drafter.draft([item]).token_ids[0].tolist()
    want = fresh.draft([DraftItem("r", 0, CONTEXT + [unguessed], 4, GREEDY, 7, "dense")])
    assert got == want.token_ids[0].tolist()


def test_tokens_past_one_round_are_no_position(draft_dir):
    """A sequence that comes back with more than the prepared round could commit (rounds
    it spent elsewhere) is looked up at no position: `accepted` stays within γ + 1."""
    looked_up = []
    cache = SpeculationCache(drafter(draft_dir), on_lookup=lambda k, hit: looked_up.append(
        (k, hit)))
    _, drafts = first_round(cache, "s")
    assert cache.take([next_item(cache, "s", drafts, (*drafts, 11, 12))]) == [None]
    assert looked_up == [(-1, False)]

def test_two_targets_sequences_keep_their_stand_ins_apart(draft_dir):
    """A replica serving two targets sees their sequence ids (each target's own prefix):
    one sequence's outcome never takes or frees the other's stand-ins."""
    cache = SpeculationCache(drafter(draft_dir))
    a, drafts_a = first_round(cache, "target-a:1")
    b, drafts_b = first_round(cache, "target-b:1")
    assert drafts_a == drafts_b and len(cache._entries) == 2  # same context, two caches
    all_kept = max(cache._entries["target-a:1"][1], key=len)
    [hit] = cache.take([next_item(cache, "target-a:1", drafts_a, all_kept)])
    assert hit is not None
    assert "target-b:1" in cache._entries and all(
        cache.drafter.runner.blocks.has(e.stand_in)
        for e in cache._entries["target-b:1"][1].values())
    [hit_b] = cache.take([next_item(cache, "target-b:1", drafts_b, all_kept)])
    assert hit_b is not None and hit_b.drafts == hit.drafts


def test_a_release_frees_the_stand_ins(draft_dir):
    cache = SpeculationCache(drafter(draft_dir))
    first_round(cache, "s")
    blocks = cache.drafter.runner.blocks
    assert blocks.num_sequences > 1
    cache.forget(["s"])
    cache.drafter.release("s")
    assert blocks.num_sequences == 0


def test_an_interrupted_fill_leaves_misses_not_wrong_drafts(draft_dir):
    cache = SpeculationCache(drafter(draft_dir))
    item = DraftItem("s", 0, list(CONTEXT), 4, GREEDY, 7, "dense")
    drafts = cache.drafter.draft([item]).token_ids[0].tolist()
    steps = iter(range(100))
    cache.fill(cache.plan([item], [drafts]), interrupted=lambda: next(steps) >= 1)
    for entry in cache._entries.get("s", (0, {}))[1].values():  # cut short: fewer drafts
        assert len(entry.drafts) < 4
    outcome = max(cache._entries.get("s", (0, {(): None}))[1], key=len)
    assert cache.take([next_item(cache, "s", drafts, outcome or (drafts[0],))]) == [None]


def test_stand_ins_never_evict_a_sequence_and_go_first():
    """A KV cache of 12 blocks (the demo draft): one sequence's stand-ins take every free
    block without evicting anything, and a second sequence then evicts stand-ins, never
    the first sequence."""
    cache = SpeculationCache(drafter(paths.demo_draft_dir(), kv_cache_mb=0.05,
                                     block_size=16))
    blocks = cache.drafter.runner.blocks
    first_round(cache, "other")
    assert blocks.num_free_blocks == 0 and len(cache.drafter.expendable) > 1
    stand_ins = set(cache.drafter.expendable)
    item = DraftItem("s", 0, list(CONTEXT), 4, GREEDY, 7, "dense")
    assert cache.drafter.draft([item]).gammas == [4]
    assert blocks.has("s") and blocks.has("other") and cache.drafter.num_evicted == 0
    assert len(cache.drafter.expendable) < len(stand_ins)


def test_a_hit_drafts_the_stand_ins_of_the_round_after(draft_dir):
    """A sequence answered from the cache keeps its guesses (the stand-in's runners-up),
    so its next round has stand-ins too: hits can follow hits. Each lookup is reported
    with the drafts its outcome kept (the replica's hit rate per position)."""
    looked_up = []
    cache = SpeculationCache(drafter(draft_dir), on_lookup=lambda k, hit: looked_up.append(
        (k, hit)))
    item, drafts = first_round(cache, "s")
    for _ in range(3):
        outcome = max(cache._entries["s"][1], key=len)  # every draft kept, the bonus guessed
        item = next_item(cache, "s", drafts, outcome)
        [entry] = cache.take([item])
        assert entry is not None
        drafts = entry.drafts
        cache.fill(cache.plan([item], [drafts]))
    assert cache.hits == 3 and looked_up == [(4, True)] * 3


def test_a_ready_only_miss_drafts_nothing_now_and_its_next_round_is_prepared(draft_dir):
    """A sequence that asks for ready drafts only and misses proposes nothing and is not
    taken in (the target decodes one token and sends the tokens again); its stand-in, the
    context drafted γ + 1 deep, answers the round after when the target's token is the
    draft's guess, with what drafting that context afresh answers."""
    cache = SpeculationCache(drafter(draft_dir))
    fresh = drafter(draft_dir)
    drafts, unguessed = round_then_unguessed(cache)
    miss = next_item(cache, "s", drafts, (unguessed,))
    miss.ready_only = True
    held = list(cache.drafter.token_ids["s"])
    assert cache.take([miss]) == [None] and cache.drafter.holds(miss)
    cache.fill(cache.plan([miss], [[]]))  # as the replica does after answering none
    assert cache.drafter.token_ids["s"] == held  # nothing taken in
    [(outcome, entry)] = cache._entries["s"][1].items()
    context = CONTEXT + [unguessed]
    guess = fresh.draft([DraftItem("g", 0, context, 1, GREEDY, 7, "dense")]).token_ids[0, 0]
    assert outcome == (guess.item(),) and entry.rank == 1
    nxt = DraftItem("s", miss.committed_len, [unguessed, guess.item()], 4, GREEDY, 7, "dense",
                    ready_only=True)
    [hit] = cache.take([nxt])
    want = fresh.draft([DraftItem("r", 0, context + [guess.item()], 4, GREEDY, 7, "dense")])
    assert hit is not None and hit.drafts == want.token_ids[0].tolist()


def test_a_cache_that_does_not_pay_prepares_now_and_then(draft_dir):
    """CacheMissChoice.prepares: until GATE_AFTER Proposes measured the hit rate and
    while it pays, every Propose has the replica prepare; below CACHE_PAYS only now and
    then (Trials), so that the rate is measured again, and every time once it pays
    again. An item that says so gets no stand-ins."""
    choice = CacheMissChoice()
    for _ in range(GATE_AFTER - 1):
        choice.observe(False, 4, 0, 0.01)
    assert choice.prepares()
    choice.observe(False, 4, 0, 0.01)
    picks = [choice.prepares() for _ in range(64)]
    assert 2 <= sum(picks) <= 4 and not any(picks[:7]), picks
    for _ in range(30):
        choice.observe(False, 4, 4, 0.01)
    assert all(choice.prepares() for _ in range(16))
    cache = SpeculationCache(drafter(draft_dir))
    item = DraftItem("s", 0, list(CONTEXT), 4, GREEDY, 7, "dense", prepare=False)
    assert cache.plan([item], [cache.drafter.draft([item]).token_ids[0].tolist()]) == []


def test_misses_are_waited_for_at_one_sequence_and_left_out_in_a_batch():
    """CacheMissChoice: nothing measured, a Propose waits for its misses (as without a
    cache); once a miss's cost is known, the ready-only wait is measured; then at 8
    sequences (7 of 8 hit) leaving the miss out pays, at one it does not: the whole step
    waits for one sequence's drafting, which its 3 kept drafts outweigh."""
    choice = CacheMissChoice()
    verify = lambda n: 0.010 + 0.0005 * n  # noqa: E731 (seconds for n positions)
    assert not choice.ready_only(8, 4, verify)
    for _ in range(20):
        choice.observe(False, 8, 7, 0.006)
        choice.observe_kept(3)
    assert choice.ready_only(8, 4, verify)
    choice.observe(True, 8, 7, 0.001)
    assert choice.ready_only(8, 4, verify) and not choice.ready_only(1, 4, verify)


@pytest.mark.slow
def test_served_greedy_with_the_cache_is_the_target_alone():
    """`outrider serve --speculation-cache`, 8 greedy streams drafted by the model only:
    rounds take drafts from the cache, some delivered beside the last verification with no
    Propose asked (and the policy leaves some misses out, drafting nothing for them that
    round), and every output is the target's own; so is it at 1 stream (drafting ahead
    answers) and 3, one past overlap_max_seqs (deliveries begin)."""
    from outrider.target_worker.main import TargetWorkerConfig

    from outrider.bench.prompts import heldout_prompts
    from outrider.client import Client
    from outrider.core.tokenizer import Tokenizer
    from outrider.local_system import LocalSystemConfig, local_system
    from tests.scraping import scrape, total

    target, draft = map(str, paths.demo_pair())
    cfg = LocalSystemConfig(target, draft, grpc_port=0, metrics=True, kv_cache_mb=32,
                            speculation_cache=True, proposer="model")
    prompts = heldout_prompts(Tokenizer(target), 8, 128)  # the demo pair's α is high there
    options = dict(max_tokens=128, temperature=0.0, ignore_eos=True, max_concurrency=8)
    with local_system(cfg) as system, Client(system.router, timeout_s=120) as client:
        spec = client.generate_batch(prompts, speculation="fixed", gamma_max=4,
                                     include_rounds=True, **options)
        plain = client.generate_batch(prompts, speculation="off", **options)
        samples = scrape(system.metrics["target"])
        fewer = {n: client.generate_batch(prompts[:n], speculation="fixed", gamma_max=4,
                                          **{**options, "max_concurrency": n})
                 for n in (1, TargetWorkerConfig.overlap_max_seqs + 1)}
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    for n, outputs in fewer.items():
        assert [s.token_ids for s in outputs] == [p.token_ids for p in plain[:n]], n
    assert sum(r.cache_rank > 0 for s in spec for r in s.rounds) > 0
    assert total(samples, "outrider_spec_cache_ready_only_steps_total") > 0
    assert total(samples, "outrider_spec_cache_delivered_rounds_total") > 0



@pytest.mark.slow
def test_a_lost_delivery_costs_drafts_never_a_token(monkeypatch):
    """Deliveries (ProposeSequence.deliver) whose call fails, one in five before the
    replica took its outcomes in and one in five after it did (the answer lost): the
    target learns nothing from them, so its next Propose of the sequence starts from what
    it knew the replica held, which rolls back to it; greedy output stays the target's
    own, and deliveries that went through still took drafts from the cache."""
    import itertools

    import grpc
    from outrider.draft_worker.main import DraftWorkerConfig, start
    from outrider.draft_worker.service import DraftService
    from outrider.target_worker.remote_drafter import RemoteDrafter

    from outrider.bench.prompts import heldout_prompts
    from outrider.core.tokenizer import Tokenizer
    from outrider.engine.spec_decode import SpeculativeDecoder

    propose, calls = DraftService.Propose, itertools.count()
    outcomes = {"lost before": 0, "lost after": 0, "taken": 0}

    def failing(self, request, context):  # (registered by start: patched before it)
        if not any(s.deliver for s in request.sequences):
            return propose(self, request, context)
        turn = next(calls) % 5  # (5: no lockstep with a collect's round and a delivery's)
        if turn == 1:
            outcomes["lost before"] += 1
            context.abort(grpc.StatusCode.INTERNAL, "lost before the replica took it in")
        reply = propose(self, request, context)
        if turn == 3:
            outcomes["lost after"] += 1
            context.abort(grpc.StatusCode.INTERNAL, "lost after the replica took it in")
        outcomes["taken"] += sum(p.cache_rank > 0 for p in reply.proposals)
        return reply

    monkeypatch.setattr(DraftService, "Propose", failing)
    target_dir, draft_dir = map(str, paths.demo_pair())
    running = start(DraftWorkerConfig(draft_dir, kv_cache_mb=32, speculation_cache=True),
                    "lost")
    remote = RemoteDrafter([running.address], "lost", "t0-", retry_after_s=0.01)
    try:
        decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(target_dir, kv_cache_mb=32)),
                                     remote, overlap_max_seqs=2)
        prompts = heldout_prompts(Tokenizer(target_dir), 8, 128)
        params = SamplingParams(max_tokens=96, ignore_eos=True)
        plain = [s.output_ids for s in decoder.generate(prompts, params, gamma=0)]
        spec = [s.output_ids for s in decoder.generate(prompts, params, gamma=4)]
    finally:
        remote.close()
        running.stop(0)
    assert spec == plain
    assert min(outcomes.values()) > 0, outcomes


def test_a_delivery_answers_each_outcome_with_what_drafting_it_answers(draft_dir):
    """Delivery (DraftService, ProposeSequence.deliver): beside the verification of a
    Proposed round the target collects the outcomes it prepared; the round after a hit
    sends no Propose, only the outcome beside its own verification, which the replica's
    stand-in takes over (its drafts are the ones verified) and answers with the next
    round's outcomes. Every delivered draft is what drafting that context afresh drafts."""
    from outrider.draft_worker.service import DraftService

    from outrider.core.sampling import sampling_to_proto
    from outrider.v1 import worker_pb2 as pb
    from outrider.wire import Q_FORMAT_CODES

    service = DraftService(drafter(draft_dir), speculation_cache=True)
    fresh = drafter(draft_dir)

    def sequence(committed_len, new, gamma, deliver=False):
        return pb.ProposeSequence(seq_id="s", committed_len=committed_len, new_token_ids=new,
                                  gamma=gamma, sampling=sampling_to_proto(GREEDY, 7),
                                  q_format=Q_FORMAT_CODES["point_mass"], deliver=deliver)

    def propose(seq, beside_target=False):
        return service.Propose(pb.ProposeRequest(sequences=[seq], beside_target=beside_target),
                               None).proposals[0]

    def drafted_afresh(context):
        fresh.release("r")
        return fresh.draft([DraftItem("r", 0, context, 4, GREEDY, 7, "point_mass")]
                           ).token_ids[0].tolist()

    drafts = list(propose(sequence(0, CONTEXT, 4)).token_ids)
    collected = propose(sequence(len(CONTEXT), [], 0, deliver=True), beside_target=True)
    outcomes = {tuple(p.outcome): list(p.token_ids) for p in collected.prepared}
    assert any(len(o) == 1 for o in outcomes) and any(len(o) == 5 for o in outcomes)
    assert list(collected.token_ids) == []  # a collect drafts nothing
    for outcome, next_drafts in outcomes.items():
        assert next_drafts == drafted_afresh(CONTEXT + list(outcome))[:len(next_drafts)]
    outcome = next(o for o in outcomes if len(o) == 1)  # the target rejected d1, took t
    assert outcome[0] != drafts[0]
    taken = propose(sequence(len(CONTEXT), list(outcome), 4, deliver=True), beside_target=True)
    assert list(taken.token_ids) == outcomes[outcome] and taken.cache_rank > 0
    context = CONTEXT + list(outcome)
    after = {tuple(p.outcome): list(p.token_ids) for p in taken.prepared}
    assert after and all(d == drafted_afresh(context + list(o))[:len(d)]
                         for o, d in after.items())
