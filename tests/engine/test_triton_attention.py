"""The GPU's paged-attention kernels (engine/kernels/triton_paged.py) held to the reference
path on CPU through Triton's interpreter: a ragged batch of decode rows, verification
chains and a token tree, grouped-query heads, a head size that is no power of two, a
sliding window and Gemma 2's soft cap; rows of padding write nothing and read zeros.
(tests/conftest.py has Triton interpret.)"""

from __future__ import annotations

import random

import pytest
import torch

from outrider.engine import attention
from outrider.engine.attention import AttentionMetadata, SequenceSlice, kv_cache_shapes
from outrider.engine.cuda_graphs import GraphedSteps
from outrider.engine.kernels import triton_paged
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from tests.checkpoints import VOCAB, save_random_checkpoint

BLOCK = 16
# (cached positions, new positions, tree masks or None) per sequence
MIX = [(37, 1, None), (0, 1, None), (70, 5, None), (16, 4, [0b1, 0b11, 0b101, 0b1001]),
       (3, 9, None), (21, 1, None)]


def batch(rng: random.Random, num_blocks: int) -> list[SequenceSlice]:
    free = rng.sample(range(num_blocks), num_blocks)  # scattered, as a cache in use has them
    seqs = []
    for cached, new, tree in MIX:
        blocks = -(-(cached + new) // BLOCK)
        seqs.append(SequenceSlice(cached, new, [free.pop() for _ in range(blocks)], tree))
    return seqs


@pytest.mark.parametrize("heads, kv_heads, head_dim, window, softcap", [
    (8, 2, 24, None, 0.0), (4, 4, 32, 20, 0.0), (6, 1, 16, None, 30.0)])
def test_the_kernels_attend_as_the_reference_path(heads, kv_heads, head_dim, window, softcap):
    rng, gen = random.Random(heads), torch.Generator().manual_seed(heads)
    num_blocks = 40
    seqs = batch(rng, num_blocks)
    rows = sum(s.query_len for s in seqs)
    caches = [torch.randn(shape, generator=gen)
              for shape in kv_cache_shapes(num_blocks, BLOCK, kv_heads, head_dim)]
    q = torch.randn(rows, heads, head_dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, head_dim, generator=gen) for _ in range(2))
    meta = AttentionMetadata.build(seqs, BLOCK, torch.device("cpu"))
    scale = head_dim ** -0.5
    expected_caches = [c.clone() for c in caches]
    expected = attention.reference_attention(q, k, v, *expected_caches, meta, window, scale,
                                             softcap)

    # two rows of padding at the end: they must neither write nor read
    pad = lambda t, value: torch.cat([t, torch.full((2,), value, dtype=t.dtype)])  # noqa: E731
    row_seq = pad(torch.tensor([i for i, s in enumerate(seqs) for _ in range(s.query_len)]), 0)
    row_slot = pad(torch.tensor([p for s in seqs for p in range(s.cached_len, s.context_len)]),
                   -1)
    trees = pad(meta.tree_masks, -1)
    slots = pad(meta.slot_mapping, -1)
    q, k, v = (torch.cat([t, torch.randn(2, *t.shape[1:], generator=gen)]) for t in (q, k, v))
    triton_paged.store_kv(k, v, *caches, slots)
    for got, want in zip(caches, expected_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    out = triton_paged.paged_attention(q, *caches, meta.block_tables, meta.context_lens,
                                       row_seq, row_slot, trees, window or 0, scale, softcap)
    torch.testing.assert_close(out[:rows], expected, rtol=1e-5, atol=1e-5)
    assert not out[rows:].any()



def test_a_padded_static_step_gives_the_eager_forwards_logits(tmp_path):
    """The CUDA graphs' bookkeeping (cuda_graphs.py) without the graphs: decode and
    verification steps written into the static buffers and padded up to the next size
    give the logits that a runner of the same checkpoint computes eagerly."""
    model_dir = save_random_checkpoint(tmp_path / "llama", seed=3)
    eager, static = (ModelRunner(RunnerConfig(str(model_dir), block_size=BLOCK, kv_cache_mb=2))
                     for _ in range(2))
    steps = GraphedSteps(static.step, static.kv_caches, BLOCK,
                         -(-static.max_model_len // BLOCK), torch.device("cpu"), capture=False)
    rng = random.Random(1)
    pending = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 33)]
    cached = [0] * len(pending)
    for width in (1, 3, 1, 4, 0):  # the prompts, then decode, verify 3, decode, verify 4
        logits = []
        for runner, step in ((eager, eager.forward),
                             (static, (lambda r: steps(r, steps.size_for(r))) if cached[0]
                              else static.forward)):
            requests = []
            for i, tokens in enumerate(pending):
                runner.blocks.append(i, len(tokens))
                requests.append(ForwardRequest(tokens, cached[i], runner.blocks.block_table(i),
                                               len(tokens)))
            logits.append(step(requests))
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
        cached = [c + len(t) for c, t in zip(cached, pending, strict=True)]
        pending = [[rng.randrange(VOCAB) for _ in range(width)] for _ in pending]


def test_a_kernel_that_cannot_run_here_turns_itself_off(monkeypatch):
    """No C compiler for Triton's launcher, an instruction the GPU lacks: one try at
    start finds out, and attention takes the reference path from then on."""
    cpu = torch.device("cpu")
    assert triton_paged.runs_here(cpu, torch.float32, 4, 2, 24, BLOCK)

    def fails(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(triton_paged, "paged_attention", fails)
    monkeypatch.setattr(triton_paged, "_failed", [])
    try:
        assert not triton_paged.runs_here(cpu, torch.float32, 4, 2, 24, BLOCK)
        assert not attention.gpu_kernel_fits(BLOCK)
    finally:
        monkeypatch.undo()
        triton_paged.triton_available.cache_clear()
    assert attention.gpu_kernel_fits(BLOCK)
