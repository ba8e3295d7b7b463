"""Random append / rollback / free keep block accounting exact, and the
cached keys/values equal a fresh recomputation."""

from __future__ import annotations

import random

import pytest
import torch

from outrider.engine.block_manager import BlockManager, OutOfBlocksError
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from tests.checkpoints import VOCAB


def cached_kv(runner: ModelRunner, seq_id) -> torch.Tensor:
    """Keys and values of every cached position: [2, layers, seq_len, kv_heads, head_dim]."""
    bs, table = runner.blocks.block_size, runner.blocks.block_table(seq_id)
    slots = torch.tensor([table[p // bs] * bs + p % bs
                          for p in range(runner.blocks.seq_len(seq_id))], dtype=torch.long)
    keys = [k.transpose(1, 3).reshape(-1, *k.shape[1:3])[slots] for k, _ in runner.kv_caches]
    return torch.stack([torch.stack([k, v[slots]]) for k, (_, v) in zip(keys, runner.kv_caches)],
                       dim=1)


def append(runner: ModelRunner, seq_id, tokens: list[int]) -> None:
    start = runner.blocks.seq_len(seq_id) if runner.blocks.has(seq_id) else 0
    runner.blocks.append(seq_id, len(tokens))
    runner.forward([ForwardRequest(tokens, start, runner.blocks.block_table(seq_id), 1)])


def test_random_operations_match_fresh_recomputation(llama_dir):
    rng = random.Random(0)
    runner = ModelRunner(RunnerConfig(str(llama_dir), block_size=4, kv_cache_mb=0.05))
    tokens: dict[int, list[int]] = {}
    num_refused = 0
    for _ in range(1000):
        op = rng.random()
        seq_id = rng.randrange(6)
        if seq_id not in tokens or op < 0.5:
            new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
            if len(tokens.get(seq_id, [])) + len(new) > 200:
                continue
            if not runner.blocks.can_append(seq_id, len(new)):
                with pytest.raises(OutOfBlocksError):
                    runner.blocks.append(seq_id, len(new))
                num_refused += 1
                continue
            append(runner, seq_id, new)
            tokens.setdefault(seq_id, []).extend(new)
        elif op < 0.85:
            keep = rng.randint(0, len(tokens[seq_id]))
            runner.blocks.rollback(seq_id, keep)
            del tokens[seq_id][keep:]
        else:
            runner.blocks.free(seq_id)
            del tokens[seq_id]
        _check_accounting(runner.blocks, tokens)

    assert num_refused > 0, "the KV budget was never reached"
    fresh = ModelRunner(RunnerConfig(str(llama_dir), block_size=4, kv_cache_mb=1))
    checked = 0
    for seq_id, seq_tokens in tokens.items():
        if not seq_tokens:
            continue
        append(fresh, seq_id, seq_tokens)
        torch.testing.assert_close(cached_kv(runner, seq_id), cached_kv(fresh, seq_id),
                                   rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked > 0
    for seq_id in list(tokens):
        runner.blocks.free(seq_id)
    assert runner.blocks.num_used_blocks == 0
    assert runner.blocks.num_free_blocks == runner.blocks.num_blocks


def _check_accounting(blocks: BlockManager, tokens: dict[int, list[int]]) -> None:
    owned = [b for s in tokens for b in blocks.block_table(s)]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) == blocks.num_used_blocks
    for s, seq_tokens in tokens.items():
        assert blocks.seq_len(s) == len(seq_tokens)
        assert len(blocks.block_table(s)) == -(-len(seq_tokens) // blocks.block_size)


def test_rollback_then_append_restores_state(llama_dir):
    """Rolling back rejected positions and writing others equals never having had them."""
    runner = ModelRunner(RunnerConfig(str(llama_dir), block_size=4, kv_cache_mb=1))
    append(runner, "a", [5, 6, 7, 8, 9])
    append(runner, "a", [100, 101, 102])  # a rejected draft
    runner.blocks.rollback("a", 5)
    append(runner, "a", [10, 11])
    append(runner, "b", [5, 6, 7, 8, 9, 10, 11])
    torch.testing.assert_close(cached_kv(runner, "a"), cached_kv(runner, "b"),
                               rtol=1e-4, atol=1e-5)


def test_block_manager_limits():
    blocks = BlockManager(num_blocks=3, block_size=4)
    blocks.append("x", 12)
    assert blocks.num_free_blocks == 0 and not blocks.can_append("x", 1)
    with pytest.raises(OutOfBlocksError):
        blocks.append("y", 1)
    blocks.rollback("x", 5)
    assert blocks.num_free_blocks == 1 and blocks.block_table("x") == [0, 1]
    with pytest.raises(ValueError, match="cannot roll"):
        blocks.rollback("x", 6)
    blocks.free("x")
    blocks.free("x")  # freeing twice is harmless
    assert blocks.num_free_blocks == 3 and blocks.num_sequences == 0
