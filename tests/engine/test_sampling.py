"""Sampling parameters, logits processing, inverse-CDF sampling and position-keyed uniforms."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from outrider.core.sampling import MAX_SEED, SamplingError, SamplingParams
from outrider.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    logits_to_probs,
    position_uniforms,
    sample_from_probs,
)

GREEDY = SamplingParams()
PLAIN = SamplingParams(temperature=1.0)


# -- SamplingParams ------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "1.0"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.0001}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": math.inf}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
])
def test_invalid_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(SamplingError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_error_is_a_value_error():
    assert issubclass(SamplingError, ValueError)


@pytest.mark.parametrize("kwargs", [
    {}, {"max_tokens": 1}, {"temperature": 0}, {"temperature": 1e-3}, {"temperature": 5},
    {"top_k": 0}, {"top_k": 1}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_p": 1},
    {"seed": 0}, {"seed": MAX_SEED},
])
def test_valid_params_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert dataclasses.asdict(params).items() >= kwargs.items()


def test_acceptance_class_is_greedy_or_the_temperature_to_a_tenth():
    assert SamplingParams().acceptance_class == ""
    assert SamplingParams(temperature=0.74).acceptance_class == "t0.7"
    assert SamplingParams(temperature=0.75, top_p=0.9).acceptance_class == "t0.8"
    assert SamplingParams(temperature=1.0).acceptance_class == "t1.0"
    assert SamplingParams(temperature=3.5).acceptance_class == "t2.0"


def test_params_are_frozen_and_greedy_flag():
    assert GREEDY.is_greedy and not PLAIN.is_greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        GREEDY.temperature = 1.0  # type: ignore[misc]


# -- logits_to_probs -----------------------------------------------------------------------------

def _distinct_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[num_rows, vocab] fp32 logits with no ties (a random permutation of a spaced grid)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-3.0, 3.0, vocab)  # [vocab]
    return torch.stack([grid[torch.randperm(vocab, generator=gen)] for _ in range(num_rows)])


def _logits_of(probs: list[float], order: list[int]) -> torch.Tensor:
    """[1, vocab] logits whose softmax is probs placed at the token ids in order."""
    logits = torch.full((1, len(probs)), 0.0)
    logits[0, order] = torch.tensor(probs).log()
    return logits


def test_greedy_rows_are_one_hot_at_argmax():
    logits = _distinct_logits(5, 11, seed=0)  # [5, 11]
    probs = logits_to_probs(logits, [GREEDY] * 5)  # [5, 11]
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 11).float()
    assert torch.equal(probs, expected)


def test_plain_rows_are_softmax_of_scaled_logits_and_sum_to_one():
    logits = torch.randn(4, 13, generator=torch.Generator().manual_seed(1))  # [4, 13]
    temps = [1.0, 0.5, 2.0, 1e-2]
    probs = logits_to_probs(logits, [SamplingParams(temperature=t) for t in temps])
    expected = torch.softmax(logits / torch.tensor(temps)[:, None], -1)
    torch.testing.assert_close(probs, expected)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert probs.shape == logits.shape and probs.dtype == torch.float32


@pytest.mark.parametrize("k", [1, 2, 5, 15, 16, 40])
def test_top_k_keeps_exactly_the_k_largest(k):
    vocab = 16
    logits = _distinct_logits(6, vocab, seed=k)  # [6, vocab]
    probs = logits_to_probs(logits, [SamplingParams(temperature=0.8, top_k=k)] * 6)
    kept = probs > 0  # [6, vocab]
    top_ids = logits.topk(min(k, vocab), dim=-1).indices
    expected = torch.zeros_like(kept).scatter_(-1, top_ids, True)
    assert torch.equal(kept, expected)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    # surviving tokens keep their relative (tempered) odds
    ref = torch.softmax((logits / 0.8).masked_fill(~expected, -math.inf), -1)
    torch.testing.assert_close(probs, ref)


# sorted masses 0.5, 0.3, 0.15, 0.05 scattered over ids 2, 0, 3, 1
TOP_P_PROBS, TOP_P_ORDER = [0.5, 0.3, 0.15, 0.05], [2, 0, 3, 1]


@pytest.mark.parametrize(("top_p", "kept_ids"), [
    (0.3, [2]),              # first token alone already reaches 0.3
    (0.7, [2, 0]),           # 0.5 < 0.7 <= 0.8
    (0.9, [2, 0, 3]),        # 0.8 < 0.9 <= 0.95
    (0.97, [2, 0, 3, 1]),    # needs everything
    (1.0, [2, 0, 3, 1]),
])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, kept_ids):
    logits = _logits_of(TOP_P_PROBS, TOP_P_ORDER)  # [1, 4]
    probs = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_p=top_p)])[0]
    full = torch.zeros(4)
    full[TOP_P_ORDER] = torch.tensor(TOP_P_PROBS)
    expected = torch.zeros(4)
    expected[kept_ids] = full[kept_ids] / full[kept_ids].sum()
    torch.testing.assert_close(probs, expected)


def test_top_k_keeps_every_token_tied_with_the_kth():
    """As transformers' TopKLogitsWarper does: a tie at the k-th value keeps all of it,
    also beside a row whose top-k is wider (the sort then covers the ties)."""
    tied = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    wide = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_k=3)]
    for batch, rows in ((tied, params[:1]), (torch.cat([tied, wide]), params)):
        probs = logits_to_probs(batch, rows)
        assert (probs[0] > 0).tolist() == [True, True, True, True, False, False]
    assert (probs[1] > 0).tolist() == [True, True, True, False, False, False]


def test_top_p_keeps_every_token_tied_at_the_nucleus_edge():
    """The nucleus is a threshold on the sorted values: tokens tied with its last one all
    stay, whatever order a sort would put them in."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -3.0]])
    probs = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_p=0.6)])[0]
    assert (probs > 0).tolist() == [True, True, True, True, False]


def _reference_truncation(logits: torch.Tensor, params: SamplingParams
                          ) -> tuple[torch.Tensor, float]:
    """What is kept, as the definition reads (min_p, then top-k, then the smallest
    likeliest prefix reaching top_p), with a full sort with indices: [vocab] bool; and
    how close a prefix's mass (in float64) comes to top_p (a decision closer than float32
    resolves is the rounding's, not the definition's)."""
    probs = logits.softmax(-1)
    keep = probs >= params.min_p * probs.max()
    order = torch.where(keep, logits, -math.inf).sort(descending=True).indices
    kept = order[:params.top_k or len(order)]
    kept = kept[keep[kept]]
    mass = logits[kept].softmax(-1).cumsum(-1)
    inside = torch.cat([torch.tensor([True]), mass[:-1] < params.top_p]) | (params.top_p >= 1)
    mask = torch.zeros_like(keep)
    mask[kept[inside]] = True
    exact = logits[kept].double().softmax(-1).cumsum(-1)
    margin = math.inf if params.top_p >= 1 else float((exact - params.top_p).abs().min())
    return mask, margin


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), top_k=st.integers(0, 40), top_p=st.floats(0.05, 1.0),
       min_p=st.sampled_from([0.0, 0.01, 0.2]), temperature=st.floats(0.3, 1.5))
def test_truncation_matches_its_definition_on_random_rows(seed, top_k, top_p, min_p,
                                                          temperature):
    """Random logits (no ties), three rows with different settings in one batch; a
    top_p whose boundary a prefix's mass meets within float32's resolution (top_p =
    1 - 1e-16, say) is no test of the definition."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)) * 3
    rows = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
            SamplingParams(temperature=1.0, top_p=0.9), PLAIN]
    probs = logits_to_probs(logits, rows)
    for row, params in enumerate(rows):
        expected, margin = _reference_truncation(logits[row] / params.temperature, params)
        assume(margin > 1e-5)
        assert ((probs[row] > 0) == expected).all(), (row, params)


def test_top_k_is_applied_before_top_p():
    # without top-k, 0.82 needs 3 tokens (mass before the 3rd is 0.8); after top-k=3 the
    # renormalised mass before the 3rd is 0.8 / 0.95 = 0.842 >= 0.82, so only 2 remain
    logits = _logits_of(TOP_P_PROBS, TOP_P_ORDER)  # [1, 4]
    only_p = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_p=0.82)])[0]
    both = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.82)])[0]
    assert (only_p > 0).nonzero().flatten().tolist() == [0, 2, 3]
    assert (both > 0).nonzero().flatten().tolist() == [0, 2]
    torch.testing.assert_close(both[[2, 0]], torch.tensor([0.625, 0.375]))


def test_mixed_batch_rows_match_rows_processed_alone():
    params = [GREEDY, SamplingParams(temperature=0.7, top_k=3), GREEDY,
              SamplingParams(temperature=1.3, top_p=0.6), PLAIN,
              SamplingParams(temperature=0.9, top_k=5, top_p=0.9)]
    logits = _distinct_logits(len(params), 12, seed=7)  # [6, 12]
    batched = logits_to_probs(logits, params)  # [6, 12]
    for i, p in enumerate(params):
        alone = logits_to_probs(logits[i:i + 1], [p])[0]
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=1e-7)
    assert torch.equal(batched[[0, 2]] > 0, batched[[0, 2]] == 1)  # greedy rows one-hot
    torch.testing.assert_close(batched.sum(-1), torch.ones(len(params)))


# -- sample_from_probs ---------------------------------------------------------------------------

NEAR_ONE = [1 - 2.0**-53, 1 - 2.0**-24, float(np.nextafter(np.float32(1), np.float32(0)))]


def test_u_zero_returns_first_nonzero_token():
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.7],
                          [0.4, 0.0, 0.6, 0.0],
                          [0.0, 0.0, 0.0, 1e-30]])  # [3, 4]
    assert sample_from_probs(probs, torch.zeros(3)).tolist() == [2, 0, 3]


def test_inverse_cdf_boundaries_and_unnormalised_input():
    probs = torch.tensor([[0.25, 0.0, 0.25, 0.5]])  # [1, 4]
    expected = {0.0: 0, 0.2499: 0, 0.25: 2, 0.4999: 2, 0.5: 3, 0.9999: 3}
    for u, token in expected.items():
        uniforms = torch.tensor([u], dtype=torch.float64)
        assert int(sample_from_probs(probs, uniforms)[0]) == token
        assert int(sample_from_probs(probs * 8, uniforms)[0]) == token  # need not sum to 1


@pytest.mark.parametrize("u", NEAR_ONE)
def test_u_near_one_returns_last_nonzero_token(u):
    # fp32 masses whose sum rounds, trailing zeros: must not run off the support
    probs = torch.tensor([[0.1] * 7 + [0.3, 0.0, 0.0]])  # [1, 10]
    assert int(sample_from_probs(probs, torch.tensor([u], dtype=torch.float64))[0]) == 7


def test_empirical_frequencies_match_probs():
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.3, 0.0, 0.4]])  # [1, 6]
    n = 60_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(3))  # [n]
    ids = sample_from_probs(probs.expand(n, -1), uniforms)  # [n]
    counts = torch.bincount(ids, minlength=6).numpy()
    assert counts[1] == counts[4] == 0
    support = [0, 2, 3, 5]
    assert stats.chisquare(counts[support], probs[0, support].numpy() * n).pvalue > 1e-3


_prob = st.one_of(st.just(0.0), st.floats(1e-30, 1.0), st.floats(0.0, 1.0))
_uniform = st.one_of(st.sampled_from([0.0, *NEAR_ONE]), st.floats(0.0, 1.0, exclude_max=True))


@settings(max_examples=200, deadline=None, database=None)
@given(rows=st.lists(st.tuples(st.lists(_prob, min_size=1, max_size=12), _uniform),
                     min_size=1, max_size=6),
       vocab=st.integers(1, 12), use_fp64=st.booleans())
def test_never_returns_a_zero_probability_token(rows, vocab, use_fp64):
    dtype = torch.float64 if use_fp64 else torch.float32
    probs = torch.zeros(len(rows), vocab, dtype=dtype)  # [num_rows, vocab]
    for i, (masses, _) in enumerate(rows):
        probs[i, :min(vocab, len(masses))] = torch.tensor(masses[:vocab], dtype=dtype)
        if not bool((probs[i] > 0).any()):
            probs[i, i % vocab] = 0.5  # every row needs some support
    uniforms = torch.tensor([u for _, u in rows], dtype=torch.float64)  # [num_rows]
    ids = sample_from_probs(probs, uniforms)
    assert ids.shape == (len(rows),) and ids.dtype == torch.long
    assert bool((probs[torch.arange(len(rows)), ids] > 0).all())


# -- position_uniforms ---------------------------------------------------------------------------

def test_position_uniforms_reproducible_shape_and_dtype():
    seeds, positions = [1, 99, MAX_SEED], np.arange(12).reshape(3, 4) + 100
    first = position_uniforms(seeds, positions, STREAM_ACCEPT)  # [3, 4]
    again = position_uniforms(list(seeds), positions.tolist(), STREAM_ACCEPT)
    assert first.shape == (3, 4) and first.dtype == torch.float64
    assert torch.equal(first, again)
    flat = position_uniforms(seeds, [5, 6, 7], STREAM_ACCEPT)  # [3]
    assert flat.shape == (3,)
    assert position_uniforms(seeds, [[], [], []], STREAM_ACCEPT).shape == (3, 0)


def test_position_uniforms_depend_on_seed_position_and_stream():
    positions = np.arange(64)[None, :]  # [1, 64]
    base = position_uniforms([42], positions, STREAM_SAMPLE)[0]  # [64]
    assert len(set(base.tolist())) == 64  # distinct per position
    for other in (position_uniforms([43], positions, STREAM_SAMPLE)[0],
                  position_uniforms([42], positions, STREAM_ACCEPT)[0],
                  position_uniforms([42], positions, STREAM_DRAFT)[0],
                  position_uniforms([42], positions + 1, STREAM_SAMPLE)[0]):
        assert not bool((other == base).any())


def test_position_uniforms_do_not_depend_on_batch_companions():
    positions = [[7, 8, 9], [0, 1, 2], [1000, 1001, 1002]]
    batched = position_uniforms([5, 6, 5], positions, STREAM_SAMPLE)  # [3, 3]
    for i, (seed, pos) in enumerate(zip([5, 6, 5], positions, strict=True)):
        assert torch.equal(batched[i], position_uniforms([seed], [pos], STREAM_SAMPLE)[0])


def test_position_uniforms_lie_in_unit_interval_and_look_uniform():
    seeds = list(range(0, 2**62, 2**62 // 200))[:200] + [MAX_SEED]
    positions = np.arange(500)[None, :].repeat(len(seeds), 0)  # [201, 500]
    values = position_uniforms(seeds, positions, STREAM_DRAFT).flatten().numpy()
    assert values.min() >= 0.0 and values.max() < 1.0
    assert stats.kstest(values, "uniform").pvalue > 1e-3
    assert len(np.unique(values)) == values.size
