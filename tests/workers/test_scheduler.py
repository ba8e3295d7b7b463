"""The target's scheduler in isolation (plain Python, no model)."""

from __future__ import annotations

from outrider.target_worker.scheduler import Scheduler, SchedulerConfig

from outrider.core.sampling import SamplingParams
from outrider.core.sequence import Sequence
from outrider.engine.block_manager import BlockManager


def make(num_blocks=8, block_size=4, budget=32, max_seqs=8):
    blocks = BlockManager(num_blocks, block_size)

    def admit(seq):
        if not blocks.has(seq.seq_id):
            seq.target_len = blocks.match_prefix(seq.seq_id, seq.token_ids)

    def preempt(seq):
        blocks.free(seq.seq_id)
        seq.target_len = 0

    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_batch_tokens=budget),
                     blocks, admit, preempt), blocks


def seq(i, prompt_len, output_len=0):
    return Sequence(i, list(range(prompt_len + output_len)), prompt_len, SamplingParams(), i)


def run_step(sched, blocks, plan):
    """What the decoder would do: take the KV and, for ready sequences, one new token."""
    for s, feed, gamma in zip(plan.seqs, plan.chunk_lens, plan.gammas):
        blocks.append(s.seq_id, feed + gamma)
        is_ready = s.target_len + feed == len(s.token_ids)
        s.target_len += feed
        if is_ready:
            s.token_ids.append(0)
            blocks.rollback(s.seq_id, s.target_len)


def test_budget_chunks_long_prompts_and_keeps_gamma_whole():
    sched, blocks = make(num_blocks=64, budget=16)
    long, short = seq(1, 40), seq(2, 3)
    sched.add(long)
    sched.add(short)
    plan = sched.schedule(lambda s: 4)
    assert plan.chunk_lens == [16] and plan.gammas == [0]  # short waits: budget spent
    run_step(sched, blocks, plan)
    plan = sched.schedule(lambda s: 4)
    assert plan.chunk_lens == [16] and plan.gammas == [0]
    run_step(sched, blocks, plan)
    plan = sched.schedule(lambda s: 4)  # 8 prompt tokens left: they and γ = 4 fit
    assert plan.chunk_lens[0] == 8 and plan.gammas[0] == 4
    # 4 tokens left: the short prompt (3 + γ 4) gets a chunk that stops one short
    assert plan.seqs == [long, short] and plan.chunk_lens[1] == 2 and plan.gammas[1] == 0
    assert sum(plan.chunk_lens) + sum(plan.gammas) <= 16


def test_last_chunk_stops_short_so_gamma_is_never_cut():
    sched, blocks = make(num_blocks=64, budget=10)
    s = seq(1, 9)
    sched.add(s)
    plan = sched.schedule(lambda _: 4)  # 9 + 4 > 10: feed 8, keep one for the γ round
    assert plan.chunk_lens == [8] and plan.gammas == [0]
    run_step(sched, blocks, plan)
    plan = sched.schedule(lambda _: 4)
    assert plan.chunk_lens == [1] and plan.gammas == [4]


def test_kv_pressure_preempts_the_youngest_and_requeues_it_first():
    sched, blocks = make(num_blocks=4, block_size=4, budget=64)
    old, young = seq(1, 6), seq(2, 6)
    sched.add(old)
    sched.add(young)
    plan = sched.schedule(lambda _: 0)
    assert plan.seqs == [old, young]
    run_step(sched, blocks, plan)
    for _ in range(3):  # both grow until 4 blocks no longer hold them
        run_step(sched, blocks, sched.schedule(lambda _: 0))
    plan = sched.schedule(lambda _: 3)
    assert sched.num_preemptions >= 1
    assert young not in sched.running and sched.waiting[0] is young
    # its KV is freed (the queue's head may hold its cached prefix again: nothing here)
    assert young.target_len == 0 and not (blocks.has(young.seq_id)
                                          and blocks.block_table(young.seq_id))
    assert plan.seqs == [old]


def test_admission_waits_for_room_in_arrival_order():
    sched, blocks = make(num_blocks=3, block_size=4, budget=64)
    big, small = seq(1, 11), seq(2, 2)
    blocks.append("other", 8)  # 2 of 3 blocks taken elsewhere
    sched.add(big)
    sched.add(small)
    plan = sched.schedule(lambda _: 0)
    assert plan.seqs == [] and list(sched.waiting) == [big, small]
    blocks.free("other")
    assert sched.schedule(lambda _: 0).seqs == [big]


def test_max_num_seqs():
    sched, _ = make(num_blocks=64, max_seqs=2)
    for i in range(4):
        sched.add(seq(i, 2))
    assert len(sched.schedule(lambda _: 0).seqs) == 2 and len(sched.waiting) == 2


def test_a_waiting_head_starts_after_its_cached_prefix_and_only_the_head_holds_one():
    sched, blocks = make(num_blocks=8, block_size=4, budget=64)
    blocks.append("earlier", 12)
    blocks.seal("earlier", list(range(12)), 12)
    blocks.free("earlier")  # 3 cached blocks of tokens 0..11
    blocks.append("other", 20)  # 5 of 8 blocks taken: no room for more than the cache
    head = seq(1, 14)
    sched.add(head)
    assert sched.schedule(lambda _: 0).seqs == []  # 2 more blocks needed, none free
    assert head.target_len == 12 and blocks.has(head.seq_id)  # waits holding its prefix
    running = seq(2, 2)
    sched.running.append(running)
    sched._preempt(running)  # a preempted sequence goes before it ...
    assert list(sched.waiting) == [running, head]
    assert head.target_len == 0 and not blocks.has(head.seq_id)  # ... which lets go
    blocks.free("other")
    plan = sched.schedule(lambda _: 0)
    assert plan.seqs == [running, head] and plan.chunk_lens == [2, 2]  # 12 of 14 cached
