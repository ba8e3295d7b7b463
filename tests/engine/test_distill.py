"""Online distillation of the draft (outrider/engine/distill.py, draft_worker/adapt.py):
the training forward is the serving forward, training on served traffic raises held-out
agreement, and adopting new weights re-syncs every sequence and keeps output exact."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from outrider.draft_worker.adapt import Adapter

from outrider.core.sampling import SamplingParams
from outrider.engine.distill import (
    DistillConfig,
    Distiller,
    Served,
    Teacher,
    TrafficBuffer,
    agreement,
    causal_logits,
    teacher_targets,
    trainable_copy,
)
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import VOCAB, save_random_checkpoint


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def runner(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_random_checkpoint(path)
    else:
        save_random_checkpoint(path, arch="mistral", sliding_window=12, head_dim=16)
    return ModelRunner(RunnerConfig(str(path), kv_cache_mb=8))


def test_the_training_forward_is_the_serving_forward(runner):
    tokens = [random.Random(1).randrange(VOCAB) for _ in range(40)]
    runner.blocks.append("x", len(tokens))
    served = runner.forward([ForwardRequest(tokens, 0, runner.blocks.block_table("x"),
                                            len(tokens))])  # [40, vocab]
    runner.blocks.free("x")
    with torch.no_grad():
        trained = causal_logits(trainable_copy(runner), torch.tensor([tokens]))[0]
        packed = causal_logits(runner.model, torch.tensor([tokens]))[0]
    torch.testing.assert_close(trained, served, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(packed, served, atol=2e-4, rtol=1e-4)


def pattern_traffic(n: int, seed: int) -> list[Served]:
    """Prompts of random tokens, each answered by a chain of one fixed rule (the next
    token is 7 t + 3 mod 64): what the "target" does, and a random draft
    does not know."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(VOCAB) for _ in range(12)]
        for _ in range(24):
            tokens.append((7 * tokens[-1] + 3) % 64)
        out.append(Served(tuple(tokens), 12))
    return out


def test_training_on_served_traffic_raises_heldout_agreement(runner):
    cfg = DistillConfig(round_tokens=1, steps_per_round=30, batch=8, lr=3e-3, max_duty=1.0,
                        holdout_every=4)
    buffer = TrafficBuffer(cfg)
    for s in pattern_traffic(64, seed=2):
        buffer.add(list(s.token_ids), s.prompt_len)
    assert len(buffer.heldout) == 12 and len(buffer.train) == 48 and buffer.is_ready()
    distiller = Distiller(runner, cfg)
    before = agreement(runner.model, list(buffer.heldout))
    verdict = distiller.train_round(buffer, runner.model)
    assert verdict.serving_agreement == pytest.approx(before)
    assert verdict.trained_agreement > before + 0.2 and verdict.weights is not None
    assert buffer.new_output_tokens == 0  # the round consumed what was new


def test_the_buffer_is_bounded_and_holds_out_a_share():
    cfg = DistillConfig(buffer_tokens=400, holdout_every=5, window=64)
    buffer = TrafficBuffer(cfg)
    for s in pattern_traffic(100, seed=3):
        buffer.add(list(s.token_ids), s.prompt_len)
    total = sum(len(s.token_ids) for s in [*buffer.train, *buffer.heldout])
    assert total <= 400 + 36 and len(buffer.heldout) >= 1
    buffer.add([1, 2, 3], 2)  # one output token: nothing to learn
    assert buffer.num_added == 100


def test_adopting_weights_resyncs_every_sequence_and_output_stays_exact(tmp_path):
    target_dir, draft_dir = tmp_path / "t", tmp_path / "d"
    save_random_checkpoint(target_dir, seed=0)
    save_random_checkpoint(draft_dir, seed=5)
    target = ModelRunner(RunnerConfig(str(target_dir), kv_cache_mb=8))
    draft = Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=8)))
    adapter = Adapter(draft, threading.Lock(), DistillConfig(round_tokens=1, steps_per_round=5,
                                                             max_duty=1.0, holdout_every=2))
    decoder = SpeculativeDecoder(target, draft)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[random.Random(i).randrange(VOCAB) for _ in range(10)] for i in range(6)]
    alone = [SpeculativeDecoder(target).generate([p], params, gamma=0)[0].output_ids
             for p in prompts]
    first = decoder.generate(prompts, params, gamma=3)
    assert [s.output_ids for s in first] == alone
    # what the draft saw committed: all but each sequence's last round (never sent to it)
    assert 6 * 24 * 0.75 <= adapter.served_tokens < 6 * 24 and adapter.buffer.is_ready()
    # a sequence the draft holds when new weights come must be sent whole again
    held = decoder.new_sequence(prompts[0], params)
    decoder.step([held], [3])
    decoder.step([held], [3])
    weights = trainable_copy(draft.runner).state_dict()
    draft.adopt({k: (v + 0.01 * torch.randn_like(v)).detach() for k, v in weights.items()})
    assert draft.version == 1 and not draft.runner.blocks.num_sequences
    assert draft.runner.blocks.num_cached_blocks == 0
    misses = draft.num_misses
    while not held.is_finished:
        decoder.step([held], [3])
    assert draft.num_misses == misses + 1  # re-synced once
    assert held.output_ids == alone[0]
    round_ = adapter.train_round()
    assert round_.version == draft.version and round_.served_tokens > 6 * 24 * 0.75


def random_traffic(n: int, seed: int) -> list[Served]:
    """Adversarial traffic: outputs of uniformly random tokens, nothing to learn."""
    rng = random.Random(seed)
    return [Served(tuple(rng.randrange(VOCAB) for _ in range(36)), 12) for _ in range(n)]


def test_random_token_traffic_is_never_adopted_and_leaves_the_draft_as_good(runner):
    """Guardrail: rounds on random tokens adopt nothing (no evidence of a gain), and a
    student they led astray is restarted from the serving weights; when real traffic
    comes back, what gets adopted is no worse than the shipped draft on it."""
    cfg = DistillConfig(round_tokens=1, steps_per_round=20, batch=8, lr=3e-3, max_duty=1.0,
                        holdout_every=4)
    drafter = Drafter(ModelRunner(runner.cfg))  # its own: adoption swaps the weights
    adapter = Adapter(drafter, threading.Lock(), cfg)
    shipped = trainable_copy(runner).eval()
    for round_index in range(3):
        for s in random_traffic(32, seed=round_index):
            adapter._served(list(s.token_ids), s.prompt_len)
        assert not adapter.train_round().adopted
    assert drafter.version == 0
    for s in pattern_traffic(64, seed=4):
        adapter._served(list(s.token_ids), s.prompt_len)
    rounds = [adapter.train_round() for _ in range(5)]
    heldout = pattern_traffic(16, seed=5)
    assert agreement(drafter.runner.model, heldout) >= agreement(shipped, heldout)
    assert any(r.adopted for r in rounds) and drafter.version >= 1


def test_a_version_worse_live_is_rolled_back(tmp_path):
    """The draft is the target itself (everything accepted); a version of noise accepts
    next to nothing live and is rolled back to the weights before it, as a new version."""
    save_random_checkpoint(tmp_path, seed=0)
    target = ModelRunner(RunnerConfig(str(tmp_path), kv_cache_mb=8))
    draft = Drafter(ModelRunner(RunnerConfig(str(tmp_path), kv_cache_mb=8)))
    adapter = Adapter(draft, threading.Lock(), DistillConfig(rollback_tokens=40))
    decoder = SpeculativeDecoder(target, draft)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[random.Random(i).randrange(VOCAB) for _ in range(10)] for i in range(4)]
    expected = [s.output_ids for s in decoder.generate(prompts, params, gamma=3)]
    drafted, accepted = draft.live_acceptance[0]
    assert drafted >= 40 and accepted == drafted  # the target agrees with itself
    weights = trainable_copy(draft.runner).state_dict()
    assert adapter.adopt({k: torch.randn_like(v) for k, v in weights.items()})
    assert draft.version == 1
    adapter.tick()  # not judged yet: nothing drafted live by version 1
    assert draft.version == 1 and adapter.num_rollbacks == 0
    again = decoder.generate(prompts, params, gamma=3)
    assert [s.output_ids for s in again] == expected  # exact whatever the draft
    drafted, accepted = draft.live_acceptance[1]
    assert drafted >= 40 and accepted < 0.5 * drafted
    adapter.tick()
    assert draft.version == 2 and adapter.num_rollbacks == 1
    decoder.generate(prompts, params, gamma=3)
    drafted, accepted = draft.live_acceptance[2]
    assert drafted >= 40 and accepted == drafted  # the weights before it, back


def with_teacher(s: Served, k: int) -> Served:
    """The target's top-k at every output position: its token first, then three others."""
    rows = {p: ((s.token_ids[p], *[(s.token_ids[p] + d) % VOCAB for d in range(1, k)]),
                (-0.01, *[-6.0 - d for d in range(1, k)]))
            for p in range(s.prompt_len, len(s.token_ids))}
    return Served(s.token_ids, s.prompt_len, Teacher.from_rows(rows, k, len(s.token_ids)))


def test_the_targets_topk_lines_up_with_the_logits_that_predict_it(runner):
    s = with_teacher(pattern_traffic(1, seed=6)[0], 4)
    ids, probs, has = teacher_targets([s.cropped(3, 30)], 27, 4)  # [1, 26, 4], [1, 26]
    # position p of the crop (p >= prompt 12 - 3) is predicted by the logits at p - 1
    assert has[0].tolist() == [t >= 8 for t in range(26)]
    for t in range(8, 26):
        assert ids[0, t, 0] == s.token_ids[3 + t + 1]
    torch.testing.assert_close(probs[has].sum(-1), torch.ones(int(has.sum())))
    assert bool((probs[has][:, 0] > 0.99).all())
    cfg = DistillConfig(round_tokens=1, steps_per_round=30, batch=8, lr=3e-3, max_duty=1.0,
                        holdout_every=4, target_topk=4)
    buffer = TrafficBuffer(cfg)
    for served in pattern_traffic(64, seed=7):
        rows = with_teacher(served, 4).teacher
        buffer.add(list(served.token_ids), served.prompt_len, dict(zip(
            rows.positions.tolist(), zip(rows.ids.tolist(), rows.logprobs.tolist()))))
    assert all(s.teacher is not None for s in buffer.train)
    verdict = Distiller(runner, cfg).train_round(buffer, runner.model)
    assert verdict.trained_agreement > verdict.serving_agreement + 0.2
