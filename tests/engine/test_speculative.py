"""Speculative greedy output equals target-only greedy output."""

from __future__ import annotations

import pytest
import torch

from outrider.core.sampling import SamplingParams
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import VOCAB

ALL = 1 << 30  # draft ahead however big the batch


def ragged_prompts(n: int = 6, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1 + 7 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def target_only(llama_dir):
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    return [s.output_ids for s in decoder.generate(ragged_prompts(), params, gamma=0)]


@pytest.fixture(scope="module", params=["perturbed", "unrelated", "perturbed-overlap"])
def decoder(request, llama_dir, draft_dir, small_draft_dir):
    draft = small_draft_dir if request.param == "unrelated" else draft_dir
    return SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                              Drafter(ModelRunner(RunnerConfig(str(draft)))),
                              overlap_max_seqs=ALL if request.param.endswith("overlap") else 0)


@pytest.mark.parametrize("gamma", range(1, 9))
def test_speculative_greedy_equals_target_greedy(decoder, target_only, gamma):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = decoder.generate(ragged_prompts(), params, gamma=gamma)
    assert [s.output_ids for s in seqs] == target_only
    assert decoder.target.blocks.num_used_blocks == 0
    assert decoder.drafter.runner.blocks.num_used_blocks == 0


def test_perturbed_draft_is_partly_accepted(llama_dir, draft_dir):
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))))
    seqs = decoder.generate(ragged_prompts(), SamplingParams(max_tokens=40, ignore_eos=True), 4)
    accepted = sum(s.stats.num_accepted_tokens for s in seqs)
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    assert 0 < accepted < drafted  # both the accept and the reject paths ran


def test_overlap_drafts_ahead_and_keeps_the_output(llama_dir, draft_dir, target_only):
    """Drafting round r+1 during round r: bonus-position candidates are verified, some
    rounds run on drafts made ahead, and the output is still the target's."""
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))),
                                 overlap_max_seqs=ALL)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = decoder.generate(ragged_prompts(), params, gamma=1)
    assert [s.output_ids for s in seqs] == target_only
    assert decoder.num_candidates > decoder.num_ahead_rounds > 0
    rounds = sum(s.stats.num_rounds for s in seqs)
    emitted = sum(s.stats.num_accepted_tokens + s.stats.num_rounds for s in seqs)
    assert emitted >= sum(len(t) for t in target_only) and rounds < emitted
    assert decoder.drafter.runner.blocks.num_used_blocks == 0


def test_mixed_gammas_in_one_batch(llama_dir, draft_dir, target_only):
    """Different γ per sequence in one batch (0 included) change nobody's output."""
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = [decoder.new_sequence(p, params) for p in ragged_prompts()]
    gammas = [0, 1, 3, 8, 2, 5]
    round_no = 0
    while not all(s.is_finished for s in seqs):
        running = [(s, (g + round_no) % 7) for s, g in zip(seqs, gammas) if not s.is_finished]
        decoder.step([s for s, _ in running], [g for _, g in running])
        round_no += 1
    assert [s.output_ids for s in seqs] == target_only


def test_seeded_sampling_is_batch_invariant(llama_dir, draft_dir):
    """A seeded sampled sequence yields the same tokens alone and inside a batch."""
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))))
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=100 + i,
                             ignore_eos=True) for i in range(len(ragged_prompts()))]
    batched = [s.output_ids for s in decoder.generate(ragged_prompts(), params, gamma=4)]
    alone = [decoder.generate([p], [sp], gamma=4)[0].output_ids
             for p, sp in zip(ragged_prompts(), params)]
    assert batched == alone


def test_stop_tokens_and_max_tokens(llama_dir, draft_dir, target_only):
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))))
    prompt, expected = ragged_prompts()[2], target_only[2]
    stop = expected[10]
    seq = decoder.generate([prompt], SamplingParams(max_tokens=40, stop_token_ids=(stop,),
                                                    ignore_eos=True), gamma=6)[0]
    assert seq.output_ids == expected[:expected.index(stop) + 1]
    assert seq.finish_reason == "stop"
    seq = decoder.generate([prompt], SamplingParams(max_tokens=7, ignore_eos=True), gamma=6)[0]
    assert seq.output_ids == expected[:7] and seq.finish_reason == "length"


def test_chunked_prefill_changes_nothing(llama_dir, draft_dir, target_only):
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = [decoder.new_sequence(p, params) for p in ragged_prompts()]
    num_steps = 0
    while not all(s.is_finished for s in seqs):
        running = [s for s in seqs if not s.is_finished]
        committed = decoder.step(running, [3] * len(running), chunk_lens=[4] * len(running))
        assert all(c == [] for s, c in zip(running, committed) if s.target_len < s.prompt_len)
        num_steps += 1
    assert [s.output_ids for s in seqs] == target_only
    assert decoder.target.blocks.num_used_blocks == 0


def test_first_token_comes_from_the_prefill_while_the_draft_takes_the_context(
        llama_dir, draft_dir, target_only):
    """Time to first token: the prefill step emits its token without speculating or
    waiting for the draft, which prefills the context meanwhile; the next round joins
    that and sends it one token. A resumed sequence speculates at once (as the run it
    continues did there)."""
    drafter = Drafter(ModelRunner(RunnerConfig(str(draft_dir))))
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))), drafter)
    prompt = ragged_prompts()[3]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seq = decoder.new_sequence(prompt, params)
    assert decoder.step([seq], [4]) == [target_only[3][:1]] and seq.last_round[:2] == (0, 0)
    assert seq.draft_len == 0  # not joined yet
    sent = []
    drafter.draft = lambda items, device=None, draft=drafter.draft: (
        sent.extend(items) or draft(items, device))
    decoder.step([seq], [4])
    assert seq.last_round[0] == 4 and [len(it.new_token_ids) for it in sent] == [1]
    assert drafter.runner.blocks.seq_len(seq.seq_id) >= len(prompt) + 1

    resumed = decoder.new_sequence(prompt, params, resume_ids=target_only[3][:5])
    decoder.step([resumed], [4])
    assert resumed.last_round[0] == 4
    assert resumed.output_ids == target_only[3][:len(resumed.output_ids)]


def test_greedy_drafts_build_no_dense_q(draft_dir):
    from outrider.engine.proposer import DraftItem

    drafter = Drafter(ModelRunner(RunnerConfig(str(draft_dir))))
    greedy = DraftItem("g", 0, [5, 6, 7], 4, SamplingParams(), seed=1)
    assert drafter.draft([greedy]).probs is None
    sampled = DraftItem("s", 0, [5, 6, 7], 4, SamplingParams(temperature=1.0), seed=1)
    assert drafter.draft([greedy, sampled]).probs.shape == (2, 4, drafter.vocab_size)
