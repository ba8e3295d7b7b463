"""Exact speculative verification (docs/DESIGN.md §3): constructed cases, determinism,
statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from outrider.core.sampling import SamplingParams
from outrider.engine.rejection import RejectionResult, dense_draft_probs, rejection_sample
from outrider.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    logits_to_probs,
    position_uniforms,
    sample_from_probs,
)

VOCAB = 8
GREEDY = SamplingParams()
PLAIN = SamplingParams(temperature=1.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _probs(logits: torch.Tensor, params: SamplingParams = PLAIN) -> torch.Tensor:
    """logits [..., vocab] -> processed probs [..., vocab], one params for every row."""
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
    return logits_to_probs(flat, [params] * flat.shape[0]).reshape(logits.shape)


def _draw(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draft tokens sampled from q [batch, gamma, vocab] -> [batch, gamma]."""
    flat = q.reshape(-1, q.shape[-1])  # [batch * gamma, vocab]
    return sample_from_probs(flat, torch.rand(flat.shape[0], generator=gen)).view(q.shape[:-1])


def _uniforms(batch: int, max_gamma: int, gen: torch.Generator):
    accept = torch.rand(batch, max_gamma, generator=gen)  # [batch, max_gamma]
    sample = torch.rand(batch, max_gamma + 1, generator=gen)  # [batch, max_gamma + 1]
    return accept, sample


def _check_padding(result: RejectionResult) -> None:
    """Emitted ids are >= 0 up to num_emitted, -1 after."""
    cols = torch.arange(result.token_ids.shape[1])
    is_emitted = cols < result.num_emitted[:, None]  # [batch, max_gamma + 1]
    assert bool((result.token_ids[is_emitted] >= 0).all())
    assert bool((result.token_ids[~is_emitted] == -1).all())


# -- constructed cases ---------------------------------------------------------------------------

def _greedy_case(batch: int, gamma: int, seed: int):
    """One-hot p from random logits; returns p [batch, gamma+1, vocab], argmax [batch, gamma+1]."""
    logits = torch.randn(batch, gamma + 1, VOCAB, generator=_gen(seed))
    p = _probs(logits, GREEDY)
    return p, logits.argmax(-1)


@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2**-24])
def test_greedy_perfect_match_accepts_all_and_adds_bonus(u):
    batch, gamma = 4, 3
    p, argmax = _greedy_case(batch, gamma, seed=0)
    draft = argmax[:, :gamma].clone()  # [batch, gamma]
    accept_u = torch.full((batch, gamma), u)
    sample_u = torch.full((batch, gamma + 1), u)
    result = rejection_sample(p, draft, dense_draft_probs(draft, VOCAB),
                              torch.full((batch,), gamma), accept_u, sample_u)
    assert result.num_accepted.tolist() == [gamma] * batch
    assert torch.equal(result.token_ids, argmax)  # drafts + bonus = target argmax at row γ
    assert result.num_emitted.tolist() == [gamma + 1] * batch


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_greedy_early_mismatch_emits_target_argmax(j):
    batch, gamma = 5, 4
    p, argmax = _greedy_case(batch, gamma, seed=1)
    draft = argmax[:, :gamma].clone()
    draft[:, j] = (argmax[:, j] + 1) % VOCAB  # wrong at j; later drafts are right but must drop
    accept_u, sample_u = _uniforms(batch, gamma, _gen(2))
    result = rejection_sample(p, draft, dense_draft_probs(draft, VOCAB),
                              torch.full((batch,), gamma), accept_u, sample_u)
    assert result.num_accepted.tolist() == [j] * batch
    expected = torch.full((batch, gamma + 1), -1)
    expected[:, :j + 1] = argmax[:, :j + 1]  # accepted drafts, then the recovered argmax
    assert torch.equal(result.token_ids, expected)


def test_greedy_target_with_sampled_draft_emits_target_argmax():
    # dense q, drafts sampled from it: any accepted token equals the argmax, the recovered
    # token is the argmax, so the round is exactly greedy target decoding
    batch, gamma = 2000, 3
    p, argmax = _greedy_case(batch, gamma, seed=3)
    gen = _gen(4)
    q = _probs(torch.randn(batch, gamma, VOCAB, generator=gen))
    draft = _draw(q, gen)
    uniforms = _uniforms(batch, gamma, gen)
    result = rejection_sample(p, draft, q, torch.full((batch,), gamma), *uniforms)
    cols = torch.arange(gamma + 1)
    is_emitted = cols < result.num_emitted[:, None]
    assert torch.equal(result.token_ids[is_emitted], argmax[is_emitted])
    assert set(result.num_accepted.tolist()) == {0, 1, 2, 3}
    _check_padding(result)


def test_empty_draft_for_whole_batch_samples_from_p():
    batch = 6
    gen = _gen(5)
    p = _probs(torch.randn(batch, 1, VOCAB, generator=gen))  # [batch, 1, vocab]
    sample_u = torch.rand(batch, 1, generator=gen)  # [batch, 1]
    result = rejection_sample(p, torch.zeros(batch, 0, dtype=torch.long),
                              torch.zeros(batch, 0, VOCAB), torch.zeros(batch, dtype=torch.long),
                              torch.zeros(batch, 0), sample_u)
    assert result.token_ids.shape == (batch, 1)
    assert torch.equal(result.token_ids[:, 0], sample_from_probs(p[:, 0], sample_u[:, 0]))
    assert result.num_accepted.tolist() == [0] * batch


def test_empty_draft_rows_in_mixed_batch_sample_from_p_row_zero():
    gammas = torch.tensor([0, 3, 1, 0, 2])
    batch, max_gamma = 5, 3
    gen = _gen(6)
    p = _probs(torch.randn(batch, max_gamma + 1, VOCAB, generator=gen))
    q = _probs(torch.randn(batch, max_gamma, VOCAB, generator=gen))
    draft = _draw(q, gen)
    accept_u, sample_u = _uniforms(batch, max_gamma, gen)
    result = rejection_sample(p, draft, q, gammas, accept_u, sample_u)
    for i in (0, 3):
        assert int(result.num_accepted[i]) == 0
        expected = sample_from_probs(p[i, :1, :], sample_u[i, :1])  # [1] from p at row 0
        assert int(result.token_ids[i, 0]) == int(expected[0])
    assert bool((result.num_accepted <= gammas).all())
    _check_padding(result)


def test_all_rejected_when_q_has_mass_only_where_p_has_none():
    batch, gamma = 1000, 3
    gen = _gen(7)
    logits = torch.randn(batch, gamma + 1, VOCAB, generator=gen)
    p = _probs(logits.index_fill(-1, torch.arange(VOCAB // 2), -torch.inf))  # support 4..7
    q = _probs(logits[:, :gamma].index_fill(-1, torch.arange(VOCAB // 2, VOCAB), -torch.inf))
    draft = _draw(q, gen)  # all in 0..3
    accept_u, sample_u = _uniforms(batch, gamma, gen)
    result = rejection_sample(p, draft, q, torch.full((batch,), gamma), accept_u, sample_u)
    assert result.num_accepted.tolist() == [0] * batch
    recovered = result.token_ids[:, 0]
    assert torch.equal(recovered, sample_from_probs(p[:, 0], sample_u[:, 0]))  # residual == p
    assert bool((recovered >= VOCAB // 2).all())
    assert len(set(recovered.tolist())) == VOCAB // 2
    _check_padding(result)


def _random_round(gammas: list[int], seed: int, garbage: bool):
    """A sampled round with γ_i per row; padding filled with junk when garbage is set."""
    gen = _gen(seed)
    batch, max_gamma = len(gammas), max(gammas)
    target_logits = torch.randn(batch, max_gamma + 1, VOCAB, generator=gen)
    p = _probs(target_logits)  # [batch, max_gamma + 1, vocab]
    q = _probs(target_logits[:, :max_gamma]
               + torch.randn(batch, max_gamma, VOCAB, generator=gen))  # [batch, max_gamma, vocab]
    draft = _draw(q, gen)  # [batch, max_gamma]
    accept_u, sample_u = _uniforms(batch, max_gamma, gen)
    if garbage:
        for i, g in enumerate(gammas):
            draft[i, g:] = torch.randint(-1, VOCAB, (max_gamma - g,), generator=gen)
            q[i, g:] = torch.rand(max_gamma - g, VOCAB, generator=gen)
            p[i, g + 1:] = torch.rand(max_gamma - g, VOCAB, generator=gen)
            accept_u[i, g:] = torch.rand(max_gamma - g, generator=gen)
    return p, draft, q, torch.tensor(gammas), accept_u, sample_u


def test_batch_invariance_different_gamma_per_row():
    gammas = [0, 1, 2, 3, 4, 2, 4]
    num_accepted_seen = set()
    for seed in range(30):
        p, draft, q, num_draft, accept_u, sample_u = _random_round(gammas, seed, garbage=True)
        batched = rejection_sample(p, draft, q, num_draft, accept_u, sample_u)
        _check_padding(batched)
        for i, g in enumerate(gammas):
            alone = rejection_sample(p[i:i + 1, :g + 1], draft[i:i + 1, :g], q[i:i + 1, :g],
                                     num_draft[i:i + 1], accept_u[i:i + 1, :g],
                                     sample_u[i:i + 1, :g + 1])
            assert torch.equal(batched.num_accepted[i:i + 1], alone.num_accepted)
            assert torch.equal(batched.token_ids[i, :g + 1], alone.token_ids[0])
            num_accepted_seen.add((g, int(alone.num_accepted[0])))
    # both partial and full acceptance were exercised for the longest drafts
    assert {(4, 0), (4, 4)} <= num_accepted_seen and len({k for g, k in num_accepted_seen
                                                         if g == 4}) >= 4


def test_padding_contents_do_not_change_results():
    gammas = [3, 0, 1, 2]
    clean = rejection_sample(*_random_round(gammas, seed=11, garbage=False))
    junk = rejection_sample(*_random_round(gammas, seed=11, garbage=True))
    assert torch.equal(clean.token_ids, junk.token_ids)
    assert torch.equal(clean.num_accepted, junk.num_accepted)


@pytest.mark.parametrize("pad_id", [VOCAB, 10**9])
def test_padding_draft_ids_outside_vocab_are_ignored(pad_id):
    # padding may hold any id, including ones past the vocabulary
    p, draft, q, num_draft, accept_u, sample_u = _random_round([2, 0, 1], seed=12, garbage=False)
    reference = rejection_sample(p, draft.masked_fill(torch.arange(2) >= num_draft[:, None], -1),
                                 q, num_draft, accept_u, sample_u)
    padded = draft.masked_fill(torch.arange(2) >= num_draft[:, None], pad_id)
    result = rejection_sample(p, padded, q, num_draft, accept_u, sample_u)
    assert torch.equal(result.token_ids, reference.token_ids)


# -- seeded determinism --------------------------------------------------------------------------

def test_rejection_sample_is_deterministic_and_leaves_inputs_alone():
    inputs = _random_round([4, 2, 0, 3], seed=13, garbage=True)
    copies = [t.clone() for t in inputs]
    first = rejection_sample(*inputs)
    second = rejection_sample(*inputs)
    assert torch.equal(first.token_ids, second.token_ids)
    assert torch.equal(first.num_accepted, second.num_accepted)
    assert all(torch.equal(a, b) for a, b in zip(inputs, copies, strict=True))


def _seeded_round(seeds: list[int], starts: list[int], gammas: list[int], p, draft, q):
    """A round whose uniforms come from position_uniforms, laid out like spec_decode.step."""
    max_gamma = draft.shape[1]
    positions = [[s + j for j in range(max_gamma + 1)] for s in starts]
    return rejection_sample(p, draft, q, torch.tensor(gammas),
                            position_uniforms(seeds, [x[:-1] for x in positions], STREAM_ACCEPT),
                            position_uniforms(seeds, positions, STREAM_SAMPLE))


def test_seeded_round_reproducible_regardless_of_batch_companions():
    p, draft, q, _, _, _ = _random_round([3, 1, 2, 0], seed=14, garbage=False)
    seeds, starts, gammas = [123, 7, 2**40, 5], [10, 200, 3, 0], [3, 1, 2, 0]
    batched = _seeded_round(seeds, starts, gammas, p, draft, q)
    for i, g in enumerate(gammas):
        alone = _seeded_round([seeds[i]], [starts[i]], [g], p[i:i + 1, :g + 1],
                              draft[i:i + 1, :g], q[i:i + 1, :g])
        assert torch.equal(batched.token_ids[i, :g + 1], alone.token_ids[0])


def test_different_seeds_give_different_rounds():
    batch, gamma = 200, 2
    p, draft, q, _, _, _ = _random_round([gamma] * batch, seed=15, garbage=False)
    first = _seeded_round([1] * batch, list(range(batch)), [gamma] * batch, p, draft, q)
    again = _seeded_round([1] * batch, list(range(batch)), [gamma] * batch, p, draft, q)
    other = _seeded_round([2] * batch, list(range(batch)), [gamma] * batch, p, draft, q)
    assert torch.equal(first.token_ids, again.token_ids)
    assert not torch.equal(first.token_ids, other.token_ids)


# -- statistical exactness -----------------------------------------------------------------------

NUM_ROUNDS = 100_000
STAT_VOCAB, STAT_GAMMA = 12, 2
PROCESSING = {
    "plain": PLAIN,
    "temp_top_k": SamplingParams(temperature=0.7, top_k=5),
    "temp_top_p": SamplingParams(temperature=1.4, top_p=0.75),
    "top_k_top_p": SamplingParams(temperature=0.9, top_k=6, top_p=0.9),
}


def _chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """tokens [n] ~ probs [vocab]? No token may fall outside the support; cells expecting
    fewer than 5 hits are pooled."""
    counts = np.bincount(tokens.numpy(), minlength=probs.shape[0])
    probs = probs.double().numpy()
    assert counts[probs == 0].sum() == 0, "emitted a token the target gives zero probability"
    expected = probs * len(tokens) / probs.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if not small.any():
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _draft_wire(fmt: str, q: torch.Tensor, gen: torch.Generator):
    """q [gamma, vocab] -> (draft ids [n, gamma], dense q [n, gamma, vocab], the q drafted from
    [gamma, vocab]) for one wire format, the draft sampling from exactly what it sends."""
    n, (gamma, vocab) = NUM_ROUNDS, q.shape
    if fmt == "point_mass":  # draft takes its argmax; ids only on the wire
        ids = q.argmax(-1).expand(n, gamma)
        return ids, dense_draft_probs(ids, vocab), None
    if fmt == "sparse":  # (id, prob) support: q's own support when truncated, else 4 random ids
        support = 5
        sparse_ids = torch.zeros(gamma, support, dtype=torch.long)  # pad id 0, prob 0
        sparse_probs = torch.zeros(gamma, support)  # [gamma, support]
        for j in range(gamma):
            nonzero = q[j].nonzero().flatten()
            if len(nonzero) == vocab:
                nonzero = torch.randperm(vocab, generator=gen)[:4]
            nonzero = nonzero[:support]
            sparse_ids[j, :len(nonzero)] = nonzero
            sparse_probs[j, :len(nonzero)] = q[j, nonzero] / q[j, nonzero].sum()
        slot = _draw(sparse_probs.expand(n, gamma, support), gen)  # [n, gamma] index into support
        ids = sparse_ids.expand(n, gamma, support).gather(-1, slot[..., None])[..., 0]
        dense = dense_draft_probs(ids, vocab, sparse_ids.expand(n, gamma, support),
                                  sparse_probs.expand(n, gamma, support))
        return ids, dense, dense[0]
    wire = q.half().float() if fmt == "fp16" else q  # fp16: the draft samples what it sends
    dense = wire.expand(n, gamma, vocab)
    return _draw(dense, gen), dense, wire


def _check_exact(p: torch.Tensor, draft, dense_q, q_sampled) -> None:
    """p [gamma+1, vocab]; one vectorised batch of NUM_ROUNDS independent rounds."""
    n, gamma = draft.shape
    gen = _gen(99)
    result = rejection_sample(p.expand(n, gamma + 1, p.shape[-1]), draft, dense_q,
                              torch.full((n,), gamma), *_uniforms(n, gamma, gen))
    _check_padding(result)
    assert _chi2_pvalue(result.token_ids[:, 0], p[0]) > 1e-3
    # acceptance is neither skipped nor faked: rate matches sum_x min(p, q), drafts kept verbatim
    q0 = q_sampled[0] if q_sampled is not None else dense_q[0, 0]
    alpha = float(torch.minimum(p[0], q0 / q0.sum()).sum())
    rate = float((result.num_accepted >= 1).double().mean())
    assert abs(rate - alpha) < 5 * (alpha * (1 - alpha) / n) ** 0.5 + 1e-9
    is_accepted = result.num_accepted >= 1
    assert torch.equal(result.token_ids[is_accepted, 0], draft[is_accepted, 0])
    # second emitted token given the first draft was accepted is distributed as p at row 1
    assert int(is_accepted.sum()) >= 1000
    assert _chi2_pvalue(result.token_ids[is_accepted, 1], p[1]) > 1e-3


@pytest.mark.parametrize("fmt", ["dense", "sparse", "point_mass", "fp16"])
@pytest.mark.parametrize("processing", list(PROCESSING))
def test_emitted_tokens_follow_target_distribution(fmt, processing):
    params = PROCESSING[processing]
    gen = _gen(1000 + 17 * list(PROCESSING).index(processing) + len(fmt))
    target_logits = 1.5 * torch.randn(STAT_GAMMA + 1, STAT_VOCAB, generator=gen)
    draft_logits = target_logits[:STAT_GAMMA] + torch.randn(STAT_GAMMA, STAT_VOCAB, generator=gen)
    p = _probs(target_logits, params)  # [gamma + 1, vocab]
    q = _probs(draft_logits, params)  # [gamma, vocab]
    if processing != "plain":
        assert bool((p == 0).any()) and bool((q == 0).any())  # truncation really happened
    _check_exact(p, *_draft_wire(fmt, q, gen))


def test_bonus_token_follows_target_bonus_row():
    gen = _gen(2024)
    p = _probs(torch.randn(STAT_GAMMA + 1, STAT_VOCAB, generator=gen))  # [3, vocab]
    q = _probs(torch.log(p[:STAT_GAMMA]) + 0.3 * torch.randn(STAT_GAMMA, STAT_VOCAB, generator=gen))
    draft, dense_q, _ = _draft_wire("dense", q, gen)
    result = rejection_sample(p.expand(NUM_ROUNDS, -1, -1), draft, dense_q,
                              torch.full((NUM_ROUNDS,), STAT_GAMMA),
                              *_uniforms(NUM_ROUNDS, STAT_GAMMA, gen))
    is_all = result.num_accepted == STAT_GAMMA
    assert int(is_all.sum()) >= 10_000
    assert _chi2_pvalue(result.token_ids[is_all, STAT_GAMMA], p[STAT_GAMMA]) > 1e-3


def test_fp16_wire_q_with_underflowing_entries():
    # q has entries below fp16's smallest subnormal (they round to 0, so the draft never
    # proposes them) and entries the rounding moves; p puts real mass on the vanished ones
    gen = _gen(31)
    p = _probs(torch.randn(STAT_GAMMA + 1, STAT_VOCAB, generator=gen))  # [3, vocab]
    q_logits = torch.randn(STAT_GAMMA, STAT_VOCAB, generator=gen)
    q_logits[:, :3] = -25.0  # q ~ 1e-11
    q = _probs(q_logits)
    draft, dense_q, wire = _draft_wire("fp16", q, gen)
    assert bool((wire[:, :3] == 0).all()) and bool((q[:, :3] > 0).all())
    assert not torch.equal(wire, q)
    assert bool((wire.gather(-1, draft.T) > 0).all())  # drafted only what the wire allows
    _check_exact(p, draft, dense_q, wire)


def test_statistical_check_detects_draft_not_sampled_from_q():
    # power check: drafts drawn uniformly while q says otherwise must break exactness
    gen = _gen(41)
    p = _probs(2.0 * torch.randn(STAT_GAMMA + 1, STAT_VOCAB, generator=gen))
    q = _probs(2.0 * torch.randn(STAT_GAMMA, STAT_VOCAB, generator=gen))
    draft = torch.randint(0, STAT_VOCAB, (NUM_ROUNDS, STAT_GAMMA), generator=gen)
    result = rejection_sample(p.expand(NUM_ROUNDS, -1, -1), draft,
                              q.expand(NUM_ROUNDS, -1, -1), torch.full((NUM_ROUNDS,), STAT_GAMMA),
                              *_uniforms(NUM_ROUNDS, STAT_GAMMA, gen))
    assert _chi2_pvalue(result.token_ids[:, 0], p[0]) < 1e-3


def test_greedy_verify_equals_rejection_sampling_of_point_masses():
    from outrider.engine.rejection import greedy_verify

    g = torch.Generator().manual_seed(4)
    batch, max_gamma, vocab = 64, 5, 7
    argmax = torch.randint(0, vocab, (batch, max_gamma + 1), generator=g)  # [batch, γ+1]
    draft = torch.where(torch.rand(batch, max_gamma, generator=g) < 0.7, argmax[:, :max_gamma],
                        torch.randint(0, vocab, (batch, max_gamma), generator=g))
    num_draft = torch.randint(0, max_gamma + 1, (batch,), generator=g)
    p = torch.nn.functional.one_hot(argmax, vocab).float()  # [batch, γ+1, vocab]
    q = torch.nn.functional.one_hot(draft, vocab).float()   # [batch, γ, vocab]
    u_accept = torch.rand(batch, max_gamma, generator=g, dtype=torch.float64)
    u_sample = torch.rand(batch, max_gamma + 1, generator=g, dtype=torch.float64)
    slow = rejection_sample(p, draft, q, num_draft, u_accept, u_sample)
    fast = greedy_verify(argmax, draft, num_draft)
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert torch.equal(fast.num_accepted, slow.num_accepted)
    assert 0 < int(fast.num_accepted.sum()) < int(num_draft.sum())


def test_a_point_mass_is_verified_against_the_targets_own_sample():
    """Sampled p, one-hot q (a lookup's, lookahead's): the round emits the token the target
    samples at each position with that position's sample uniform, keeping the drafts equal
    to it (greedy_verify against those samples): what the target alone emits for the seed,
    whatever was proposed."""
    from outrider.engine.rejection import greedy_verify

    g = torch.Generator().manual_seed(5)
    batch, max_gamma, vocab = 64, 5, 7
    p = torch.softmax(2 * torch.randn(batch, max_gamma + 1, vocab, generator=g), -1)
    u_accept = torch.rand(batch, max_gamma, generator=g, dtype=torch.float64)
    u_sample = torch.rand(batch, max_gamma + 1, generator=g, dtype=torch.float64)
    own = sample_from_probs(p.reshape(-1, vocab), u_sample.reshape(-1)).view(batch, -1)
    draft = torch.where(torch.rand(batch, max_gamma, generator=g) < 0.7, own[:, :max_gamma],
                        torch.randint(0, vocab, (batch, max_gamma), generator=g))
    num_draft = torch.randint(0, max_gamma + 1, (batch,), generator=g)
    q = torch.nn.functional.one_hot(draft, vocab).float()  # [batch, γ, vocab]
    result = rejection_sample(p, draft, q, num_draft, u_accept, u_sample)
    want = greedy_verify(own, draft, num_draft)
    assert torch.equal(result.token_ids, want.token_ids)
    assert 0 < int(want.num_accepted.sum()) < int(num_draft.sum())
