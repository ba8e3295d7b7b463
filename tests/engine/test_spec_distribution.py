"""Must show 5: with a real draft and target, sampling with speculation gives the
target-only distribution of the generated tokens (two-sample tests). The 1st token comes
from the prefill step, which never speculates; the 2nd and 3rd from the first
speculative round (a verified draft token and the bonus, or a recovered token)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.sampling import SamplingParams
from outrider.engine.spec_decode import SpeculativeDecoder

NUM_SAMPLES = 6000
PROMPT = [7, 41, 99, 12, 250, 3]

ALL = 1 << 30  # draft ahead however big the batch


def sample_tokens(decoder: SpeculativeDecoder, gamma: int, seed_base: int,
                  **sampling) -> list[tuple[int, int]]:
    params = [SamplingParams(max_tokens=3, seed=seed_base + i, ignore_eos=True, **sampling)
              for i in range(NUM_SAMPLES)]
    seqs = decoder.generate([PROMPT] * NUM_SAMPLES, params, gamma=gamma)
    return [tuple(s.output_ids) for s in seqs]


def two_sample_pvalue(a: list, b: list, min_count: int = 10) -> float:
    """Chi-square test of homogeneity; categories rarer than `min_count` are pooled."""
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    rare = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] < min_count]
    table = np.array([[ca[k] for k in keys] + [sum(ca[k] for k in rare)],
                      [cb[k] for k in keys] + [sum(cb[k] for k in rare)]])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table).pvalue


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def decoder(request, llama_dir, draft_dir):
    """overlap: the 3rd token comes from verifying a bonus-position candidate whenever
    the round's draft token is accepted."""
    big = RunnerConfig(str(llama_dir), kv_cache_mb=64)
    return SpeculativeDecoder(ModelRunner(big),
                              Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=64))),
                              overlap_max_seqs=ALL if request.param else 0,
                              overlap_sampled=request.param)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=1.0),
                                      dict(temperature=0.8, top_k=12, top_p=0.9)],
                         ids=["full-vocab", "top-k-top-p"])
def test_speculative_sampling_matches_target_distribution(decoder, sampling):
    spec = sample_tokens(decoder, gamma=3, seed_base=0, **sampling)
    plain = sample_tokens(decoder, gamma=0, seed_base=10**6, **sampling)
    for position in range(3):
        assert two_sample_pvalue([t[position] for t in spec],
                                 [t[position] for t in plain]) > 0.001
    assert two_sample_pvalue([t[1:] for t in spec], [t[1:] for t in plain]) > 0.001  # joint
    assert decoder.target.blocks.num_used_blocks == 0
    assert (decoder.num_candidates > NUM_SAMPLES // 10) == bool(decoder.overlap_max_seqs)


@pytest.mark.slow
def test_two_sample_test_detects_a_wrong_distribution(decoder):
    """The test above has power: a different temperature is detected."""
    hot = sample_tokens(decoder, gamma=3, seed_base=0, temperature=1.0)
    cold = sample_tokens(decoder, gamma=0, seed_base=10**6, temperature=0.8)
    assert two_sample_pvalue([t[1] for t in hot], [t[1] for t in cold]) < 0.001
