"""Attention over a ragged batch with a paged (block) KV cache.

Every sequence brings its own number of new positions (a prefill chunk, one decode
token, or 1+γ verification tokens). New keys/values are written to their cache slots,
then each sequence's whole context is gathered from the cache and attended to in one
padded SDPA call for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class SequenceSlice:
    """Host-side description of one sequence in a forward pass."""

    cached_len: int          # positions already in the KV cache
    query_len: int           # new positions in this pass
    block_table: list[int]   # KV blocks holding positions [0, cached_len + query_len)

    @property
    def context_len(self) -> int:
        return self.cached_len + self.query_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [num_tokens] cache slot for each new token
    kv_slots: torch.Tensor           # [batch, max_ctx] cache slot of every context position
    pad_index: torch.Tensor | None   # [num_tokens] row in the [batch * max_q] padded queries
    max_query_len: int
    query_positions: torch.Tensor    # [batch, max_q] absolute position of each padded query
    context_lens: torch.Tensor       # [batch]
    is_uniform_context: bool         # every sequence has max_ctx positions
    masks: dict = field(default_factory=dict)  # window -> [batch, 1, max_q, max_ctx] bool | None

    @classmethod
    def build(cls, seqs: list[SequenceSlice], block_size: int,
              device: torch.device) -> AttentionMetadata:
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        batch = len(seqs)
        # sizes from the host-side lists: no device round trips
        max_blocks = max(len(s.block_table) for s in seqs)
        max_q = max(s.query_len for s in seqs)
        context_lens = [s.context_len for s in seqs]
        max_ctx = max(context_lens)
        is_dense = all(s.query_len == max_q for s in seqs)
        tables = as_long([s.block_table + [0] * (max_blocks - len(s.block_table))
                          for s in seqs])  # [batch, max_blocks]
        cached = as_long([s.cached_len for s in seqs])  # [batch]
        query_lens = as_long([s.query_len for s in seqs])  # [batch]
        pos = torch.arange(max_ctx, device=device)
        kv_slots = tables[:, pos // block_size] * block_size + pos % block_size  # [batch, max_ctx]
        offsets = torch.arange(max_q, device=device)
        q_pos = cached[:, None] + offsets  # [batch, max_q]
        is_real = offsets < query_lens[:, None]  # [batch, max_q]
        slot_mapping = kv_slots.gather(1, q_pos.clamp(max=max_ctx - 1))
        slot_mapping = slot_mapping.flatten() if is_dense else slot_mapping[is_real]
        pad_index = (None if is_dense else
                     torch.arange(batch * max_q, device=device).view(batch, max_q)[is_real])
        return cls(slot_mapping=slot_mapping, kv_slots=kv_slots, pad_index=pad_index,
                   max_query_len=max_q, query_positions=q_pos,
                   context_lens=as_long(context_lens),
                   is_uniform_context=min(context_lens) == max_ctx)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Causal (and sliding-window) mask, built once per window size per forward."""
        if window not in self.masks:
            self.masks[window] = self._build_mask(window)
        return self.masks[window]

    def _build_mask(self, window: int | None) -> torch.Tensor | None:
        max_ctx = self.kv_slots.shape[1]
        if (self.max_query_len == 1 and self.is_uniform_context
                and (window is None or max_ctx <= window)):
            return None  # every query sees every cached key
        key_pos = torch.arange(max_ctx, device=self.kv_slots.device)  # [max_ctx]
        q_pos = self.query_positions.unsqueeze(-1)  # [batch, max_q, 1]
        mask = (key_pos <= q_pos) & (key_pos < self.context_lens[:, None, None])
        if window is not None:
            mask &= key_pos > q_pos - window
        mask[..., 0] |= ~mask.any(-1)  # padded query rows: attend somewhere, avoid NaN
        return mask.unsqueeze(1)  # [batch, 1, max_q, max_ctx]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, window: int | None, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim];
    k_cache, v_cache: [num_slots, kv_heads, head_dim]. Returns [num_tokens, heads * head_dim]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    batch, max_q = meta.kv_slots.shape[0], meta.max_query_len
    num_tokens, heads, head_dim = q.shape
    if meta.pad_index is None:
        q_pad = q.view(batch, max_q, heads, head_dim)
    else:
        q_pad = q.new_zeros(batch * max_q, heads, head_dim).index_copy_(0, meta.pad_index, q)
        q_pad = q_pad.view(batch, max_q, heads, head_dim)
    keys = k_cache[meta.kv_slots].transpose(1, 2)  # [batch, kv_heads, max_ctx, head_dim]
    values = v_cache[meta.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys, values, attn_mask=meta.mask(window), scale=scale,
        enable_gqa=keys.shape[1] != heads)  # [batch, heads, max_q, head_dim]
    out = out.transpose(1, 2).reshape(batch * max_q, heads * head_dim)
    return out if meta.pad_index is None else out.index_select(0, meta.pad_index)
