"""The C++ paged-attention kernel against the pure-torch reference path and a dense
per-sequence reference: ragged batches mixing decode, verification and prefill rows,
prefix-shared blocks, sliding windows, grouped KV heads, block sizes below, at and above
its 16-key tile, head_dims that are not a multiple of 16, token trees, float32 and
bfloat16; and the fallback where no kernel can be built."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from outrider.engine.attention import (
    AttentionMetadata,
    SequenceSlice,
    kv_cache_shapes,
    reference_attention,
)
from outrider.engine.kernels import cpu_kernels_loaded
from outrider.engine.tree import tree_masks
from tests.toolchain import needs_compiler

# (cached positions, new positions): prefill chunks fresh and over a cache, verification
# rows of several γ, decode rows, long contexts
MIX = [(0, 41), (23, 36), (0, 3), (41, 5), (17, 9), (60, 1), (5, 1), (0, 1), (300, 5),
       (700, 1)]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}  # bf16: one unit in the last place


@needs_compiler
def test_the_kernel_builds_here():
    """This machine has a compiler: every other test below must exercise the kernel, not
    pass on the fallback."""
    assert cpu_kernels_loaded()


def ragged_batch(mix, dtype, heads, kv_heads, head_dim, block_size, shared_prefix=0,
                 seed=0):
    """Caches filled with noise, block tables drawn at random; the first two sequences
    share their first `shared_prefix` blocks (a prefix-cache hit)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 400
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    caches = torch.randn(k_shape, dtype=dtype), torch.randn(v_shape, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for i, (cached, new) in enumerate(mix):
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        if i == 1 and shared_prefix:
            table[:shared_prefix] = seqs[0].block_table[:shared_prefix]
        seqs.append(SequenceSlice(cached, new, table))
    tokens = sum(new for _, new in mix)
    qkv = [torch.randn(tokens, n, head_dim, dtype=dtype) for n in (heads, kv_heads, kv_heads)]
    return seqs, caches, qkv


def run_kernel(seqs, caches, qkv, block_size, window, trees=None, softcap=0.0):
    assert cpu_kernels_loaded()  # (built and registered: whichever test runs first)
    meta = AttentionMetadata.build(seqs, block_size, torch.device("cpu"))
    k_cache, v_cache = (c.clone() for c in caches)
    q, k, v = qkv
    out = torch.ops.outrider_cpu.paged_attention(
        q, k, v, k_cache, v_cache, meta.slot_mapping, meta.query_start, meta.context_lens,
        meta.block_tables, trees, window or 0, q.shape[-1] ** -0.5, softcap)
    return out, (k_cache, v_cache)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(5, 1, 64), (8, 2, 16), (4, 4, 40)])
@pytest.mark.parametrize("block_size", [16, 4, 32])
@pytest.mark.parametrize("window", [None, 24])
def test_kernel_equals_the_reference_path(dtype, heads, kv_heads, head_dim, block_size,
                                          window):
    seqs, caches, qkv = ragged_batch(MIX, dtype, heads, kv_heads, head_dim, block_size)
    out, written = run_kernel(seqs, caches, qkv, block_size, window)
    meta = AttentionMetadata.build(seqs, block_size, torch.device("cpu"))
    k_cache, v_cache = (c.clone() for c in caches)
    expected = reference_attention(*qkv, k_cache, v_cache, meta, window, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])
    assert torch.equal(written[0], k_cache) and torch.equal(written[1], v_cache)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
def test_soft_capped_scores_equal_the_reference_path(dtype, window):
    """Gemma 2's attention logit soft-capping: the kernel's tanh against torch's."""
    seqs, caches, qkv = ragged_batch(MIX, dtype, 8, 2, 16, 16)
    qkv = (qkv[0] * 4, *qkv[1:])  # larger scores, so the cap of 2 bends most of them
    out, _ = run_kernel(seqs, caches, qkv, 16, window, softcap=2.0)
    meta = AttentionMetadata.build(seqs, 16, torch.device("cpu"))
    expected = reference_attention(*qkv, *(c.clone() for c in caches), meta, window,
                                   16 ** -0.5, softcap=2.0)
    uncapped = reference_attention(*qkv, *(c.clone() for c in caches), meta, window,
                                   16 ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])
    assert not torch.allclose(expected.float(), uncapped.float(), atol=10 * TOLERANCE[dtype])


@needs_compiler
def test_prefix_shared_blocks_are_read_by_both_sequences():
    """Two sequences on the same first blocks (a prefix hit) each see the shared keys."""
    mix = [(64, 1), (64, 5)]
    seqs, caches, qkv = ragged_batch(mix, torch.float32, 4, 2, 32, 16, shared_prefix=4)
    out, _ = run_kernel(seqs, caches, qkv, 16, None)
    meta = AttentionMetadata.build(seqs, 16, torch.device("cpu"))
    expected = reference_attention(*qkv, *(c.clone() for c in caches), meta, None, 32 ** -0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)


def dense_tree_attention(q, keys, values, cached, parents, scale):
    """One sequence: q [n, heads, dim] for tree nodes at slots cached..cached+n-1, keys
    and values [cached + n, kv_heads, dim]; a node sees the context, its ancestors and
    itself."""
    n, heads, _ = q.shape
    seen = torch.zeros(n, cached + n, dtype=torch.bool)
    seen[:, :cached] = True
    for node in range(n):
        walk = node
        while walk != -1:
            seen[node, cached + walk] = True
            walk = parents[walk]
    fold = heads // keys.shape[1]
    k = keys.float().repeat_interleave(fold, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.float().repeat_interleave(fold, dim=1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ k.transpose(1, 2)) * scale  # [heads, n, ctx]
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_see_their_ancestors_only(dtype, path):
    """Token trees: each node's row attends to the context and its own ancestors, given as
    a bitmask of the positions before it (bit d: the key d positions back), on the kernel
    and on the reference path (GPUs); the third sequence's chain of 70 nodes reaches past
    the mask's 64 positions, which are context."""
    if path == "kernel" and not cpu_kernels_loaded():
        pytest.skip("no compiler: the kernel is not built here")
    rng = random.Random(3)
    trees = {0: [-1, 0, 0, 1, 1, 2, 5, 5, 3], 1: [-1, 0, 1, 2], 2: [-1],
             3: [-1, *range(69)]}  # parent per node
    mix = [(37, len(trees[0])), (120, len(trees[1])), (5, len(trees[2])), (9, len(trees[3]))]
    seqs, caches, qkv = ragged_batch(mix, dtype, 6, 2, 32, 16, seed=rng.randrange(100))
    for seq, parents in zip(seqs, trees.values(), strict=True):
        seq.tree_masks = tree_masks(parents)
    meta = AttentionMetadata.build(seqs, 16, torch.device("cpu"))
    k_cache, v_cache = (c.clone() for c in caches)
    if path == "kernel":
        out, (k_cache, v_cache) = run_kernel(seqs, caches, qkv, 16, None, meta.tree_masks)
    else:
        out = reference_attention(*qkv, k_cache, v_cache, meta, None, 32 ** -0.5)
    keys_by_slot = k_cache.transpose(1, 3).transpose(2, 3).reshape(-1, 2, 32)
    row = 0
    for seq, parents in zip(seqs, trees.values(), strict=True):
        slots = [seq.block_table[p // 16] * 16 + p % 16 for p in range(seq.context_len)]
        n = seq.query_len
        expected = dense_tree_attention(qkv[0][row:row + n], keys_by_slot[slots],
                                        v_cache[slots], seq.cached_len, parents, 32 ** -0.5)
        torch.testing.assert_close(out[row:row + n].float(), expected, rtol=0,
                                   atol=TOLERANCE[dtype] * 2)
        row += n


def test_a_machine_without_a_compiler_falls_back_with_one_log_line(tmp_path):
    """No compiler (CXX names none, the kernel cache is empty): one line says so, and
    `outrider generate --local` serves on the reference path."""
    env = dict(os.environ, CXX="/nonexistent/c++", OUTRIDER_KERNEL_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "outrider.cli", "generate", "--local",
                           "--max-tokens", "8", "def f(x):"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "CPU kernels" in line]
    assert len(said) == 1 and "pure-torch path" in said[0], done.stderr
    assert done.stdout.strip()  # the completion


@needs_compiler
def test_a_build_killed_midway_leaves_no_lock_that_stops_the_next_load():
    """torch's lock file, left in the kernel cache by a build that was killed (a replica
    stopped mid-start), is found stale and removed by the next loader, which holds the
    cache's own lock (freed by the kernel when a holder dies) instead of waiting forever."""
    import fcntl

    from outrider.engine.kernels import _build_key, build_dir, cpu_kernels_loaded

    assert cpu_kernels_loaded()  # built (or reused) in the shared cache
    directory = build_dir() / f"outrider_cpu_{_build_key()}"
    with open(directory / ".outrider-build", "a") as handle:  # (no loader mid-way)
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").touch()
    done = subprocess.run([sys.executable, "-c", "from outrider.engine.kernels import "
                           "cpu_kernels_loaded; assert cpu_kernels_loaded()"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (directory / "lock").exists()
