"""Ragged attention: one forward mixing fresh prefills, chunked prefills over a cache,
verification rows and decode rows gives every sequence the logits it gets alone, for
grouped-query attention and for a sliding window, on the C++ kernel's path and on the
reference path (there prefill chunks are attended apart from the short queries and GQA
heads are folded into query rows)."""

from __future__ import annotations

import random

import pytest
import torch

from outrider.engine.attention import SHORT_QUERY
from outrider.engine.kernels import cpu_kernels_loaded, use_cpu_kernels
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from tests.checkpoints import VOCAB, save_random_checkpoint
from tests.toolchain import HAS_COMPILER

# (cached positions, new positions) per sequence: a fresh long prefill, a long chunk over
# a cache, a short fresh prompt, verification rows of several γ, decode rows
MIX = [(0, SHORT_QUERY + 9), (23, SHORT_QUERY + 4), (0, 3), (41, 5), (17, 9), (60, 1),
       (5, 1), (0, 1)]


@pytest.fixture(scope="module", params=["llama-gqa", "mistral-window"])
def model_dir(request, tmp_path_factory):
    overrides = (dict(arch="mistral", sliding_window=24, head_dim=16)
                 if request.param == "mistral-window" else dict(arch="llama"))
    return save_random_checkpoint(tmp_path_factory.mktemp(request.param), seed=5,
                                  **overrides)


@pytest.fixture(params=["kernel", "reference"])
def attention_path(request):
    if request.param == "kernel" and not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel cannot be built on this machine")
    use_cpu_kernels(request.param == "kernel")
    # a compiler but a failed build: the kernel rows would hold the reference to itself
    assert cpu_kernels_loaded() == (request.param == "kernel")
    yield request.param
    use_cpu_kernels(True)


def runner(model_dir) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), block_size=4, kv_cache_mb=2))


def forward_all(r: ModelRunner, seq_id: int, tokens: list[int], cached: int) -> None:
    """Cache `tokens[:cached]` of a sequence (one forward)."""
    if cached:
        r.blocks.append(seq_id, cached)
        r.forward([ForwardRequest(tokens[:cached], 0, r.blocks.block_table(seq_id), 1)])


def test_mixed_batch_equals_each_sequence_alone(model_dir, attention_path):
    rng = random.Random(0)
    contexts = [[rng.randrange(VOCAB) for _ in range(c + n)] for c, n in MIX]
    mixed = runner(model_dir)
    for i, (cached, _) in enumerate(MIX):
        forward_all(mixed, i, contexts[i], cached)
    requests = []
    for i, (cached, new) in enumerate(MIX):
        mixed.blocks.append(i, new)
        requests.append(ForwardRequest(contexts[i][cached:], cached,
                                       mixed.blocks.block_table(i), new))
    together = mixed.forward(requests)  # [sum(new), vocab]: every new position's logits

    offset = 0
    for i, (cached, new) in enumerate(MIX):
        alone = runner(model_dir)  # fresh cache, the whole context at once
        alone.blocks.append(0, cached + new)
        expected = alone.forward([ForwardRequest(contexts[i], 0, alone.blocks.block_table(0),
                                                 cached + new)])[cached:]
        torch.testing.assert_close(together[offset:offset + new], expected,
                                   rtol=1e-4, atol=1e-4, msg=f"sequence {i} {MIX[i]}")
        offset += new
