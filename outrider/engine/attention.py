"""Attention over a ragged batch with a paged (block) KV cache.

Every sequence brings its own number of new positions (a prefill chunk, one decode
token, or 1+γ verification tokens). New keys/values are written to their cache slots,
then every query attends to its sequence's context. On CPU one C++ call per layer does
both for the whole batch, reading the cache blocks in place (`kernels/`); on a GPU a
Triton kernel does for steps of short queries (`kernels/triton_paged.py`, the metadata's
`rows`); elsewhere, or where neither runs, the reference path below groups the
sequences, one SDPA call each:
  - every sequence with a short query (decode, verification) in one padded batch, its
    context gathered block by block from the cache;
  - each prefill chunk on its own, so a 500-token chunk never pads the decoding
    sequences of its step to 500 queries (a mixed step would cost several times the two
    alone); a chunk with nothing cached attends to its own keys, causally, with no
    gather at all.

Cache layout (one pair per layer): keys [blocks, kv_heads, head_dim, block_size], each
block transposed so the kernel's 16 scores of a row are one vector; values [blocks *
block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from outrider.engine.kernels import cpu_kernels_loaded, triton_paged

SHORT_QUERY = 32  # sequences with at most this many new positions share one padded batch


@dataclass
class SequenceSlice:
    """Host-side description of one sequence in a forward pass."""

    cached_len: int          # positions already in the KV cache
    query_len: int           # new positions in this pass
    block_table: list[int]   # KV blocks holding positions [0, cached_len + query_len)
    # a token tree's: per new position, the keys it sees among the 64 before it (bit d:
    # d positions back; engine/tree.py); None: causal
    tree_masks: list[int] | None = None

    @property
    def context_len(self) -> int:
        return self.cached_len + self.query_len


@dataclass
class AttentionGroup:
    """Sequences attended in one padded SDPA call."""

    rows: slice | torch.Tensor      # their rows of the flat [num_tokens] queries
    pad_index: torch.Tensor | None  # [rows] row in the [batch * max_q] padded queries
    block_tables: torch.Tensor      # [batch, max_blocks]
    max_query_len: int
    max_context_len: int
    query_positions: torch.Tensor   # [batch, max_q] absolute position of each padded query
    context_lens: torch.Tensor      # [batch]
    is_uniform_context: bool        # every sequence has max_context_len positions
    is_fresh_prefill: bool          # one sequence, nothing cached: its own keys are the context
    tree_masks: torch.Tensor | None  # [batch, max_q] int64 (-1: causal), None: no trees
    masks: dict = field(default_factory=dict)  # (window, heads per KV head, dtype) -> mask

    @classmethod
    def build(cls, seqs: list[SequenceSlice], rows: slice | torch.Tensor,
              device: torch.device) -> AttentionGroup:
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        max_blocks = max(len(s.block_table) for s in seqs)
        max_q = max(s.query_len for s in seqs)
        context_lens = [s.context_len for s in seqs]
        offsets = torch.arange(max_q, device=device)
        query_lens = as_long([s.query_len for s in seqs])  # [batch]
        pad_index, trees = None, None
        if any(s.tree_masks for s in seqs):
            trees = as_long([(s.tree_masks or [-1] * s.query_len) + [-1] * (max_q - s.query_len)
                             for s in seqs])
        if any(s.query_len != max_q for s in seqs):
            is_real = offsets < query_lens[:, None]  # [batch, max_q]
            pad_index = torch.arange(len(seqs) * max_q, device=device).view(-1, max_q)[is_real]
        return cls(rows=rows, pad_index=pad_index,
                   block_tables=as_long([s.block_table + [0] * (max_blocks - len(s.block_table))
                                         for s in seqs]),
                   max_query_len=max_q, max_context_len=max(context_lens),
                   query_positions=as_long([s.cached_len for s in seqs])[:, None] + offsets,
                   context_lens=as_long(context_lens),
                   is_uniform_context=min(context_lens) == max(context_lens),
                   is_fresh_prefill=len(seqs) == 1 and seqs[0].cached_len == 0,
                   tree_masks=trees)

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    def mask(self, window: int | None, fold: int = 1,
             dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """Causal (and sliding-window) mask as an additive [batch, 1, fold * max_q, max_ctx]
        tensor (0 or -inf) for `fold` query heads per KV head: built once per forward and
        shared by every layer (building it per layer, and SDPA turning a boolean mask
        into this per call, cost 10-15 % of a verification step's attention)."""
        key = (window, fold, dtype)
        if key not in self.masks:
            allowed = self._build_mask(window)
            self.masks[key] = None if allowed is None else torch.zeros(
                allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf")).repeat(1, 1, fold, 1)
        return self.masks[key]

    def _build_mask(self, window: int | None) -> torch.Tensor | None:
        max_ctx = self.max_context_len
        if (self.max_query_len == 1 and self.is_uniform_context and self.tree_masks is None
                and (window is None or max_ctx <= window)):
            return None  # every query sees every cached key
        key_pos = torch.arange(max_ctx, device=self.block_tables.device)  # [max_ctx]
        q_pos = self.query_positions.unsqueeze(-1)  # [batch, max_q, 1]
        mask = (key_pos <= q_pos) & (key_pos < self.context_lens[:, None, None])
        if window is not None:
            mask &= key_pos > q_pos - window
        if self.tree_masks is not None:  # bit d: the key d positions back is seen
            back = q_pos - key_pos  # [batch, max_q, max_ctx]
            trees = self.tree_masks.unsqueeze(-1)
            bit = (trees >> back.clamp(0, 63)) & 1
            mask &= (trees == -1) | (back < 0) | (back >= 64) | (bit == 1)
        mask[..., 0] |= ~mask.any(-1)  # padded query rows: attend somewhere, avoid NaN
        return mask.unsqueeze(1)  # [batch, 1, max_q, max_ctx]

    def is_plain_causal(self, window: int | None) -> bool:
        """A fresh prefill without a window that cuts in: SDPA's own causal path."""
        return self.is_fresh_prefill and self.tree_masks is None and (
            window is None or self.max_context_len <= window)


@dataclass
class AttentionMetadata:
    """What attention needs of a forward, built once and shared by every layer."""

    seqs: list[SequenceSlice]
    slot_mapping: torch.Tensor    # [num_tokens] int64: cache slot for each new token
    query_start: torch.Tensor     # [seqs + 1] int32: each sequence's first row, then the total
    context_lens: torch.Tensor    # [seqs] int32: cached + new positions
    block_tables: torch.Tensor    # [seqs, max_blocks] int32
    block_size: int
    tree_masks: torch.Tensor | None = None  # [num_tokens] int64 (-1: causal); None: no trees
    # [2, num_tokens]: each row's sequence and its query's slot in it, for the GPU's
    # kernel (triton_paged), which takes steps of short queries; None: the other paths
    rows: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[SequenceSlice], block_size: int,
              device: torch.device) -> AttentionMetadata:
        slots, starts = [], [0]
        for s in seqs:
            starts.append(starts[-1] + s.query_len)
            slots += slots_of(s.block_table, s.cached_len, s.context_len, block_size)
        width = max(len(s.block_table) for s in seqs)
        as_int = functools.partial(torch.tensor, dtype=torch.int32, device=device)
        trees = None
        if any(s.tree_masks for s in seqs):
            trees = torch.tensor([m for s in seqs for m in (s.tree_masks or [-1] * s.query_len)],
                                 dtype=torch.long, device=device)
        rows = None
        if device.type == "cuda" and gpu_kernel_takes(seqs, block_size):
            rows = as_int([[i for i, s in enumerate(seqs) for _ in range(s.query_len)],
                           [p for s in seqs for p in range(s.cached_len, s.context_len)]])
        return cls(seqs, torch.tensor(slots, dtype=torch.long, device=device), as_int(starts),
                   as_int([s.context_len for s in seqs]),
                   as_int([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]),
                   block_size, trees, rows)

    @functools.cached_property
    def groups(self) -> list[AttentionGroup]:
        """The reference path's SDPA calls: short queries first, then each prefill chunk."""
        seqs, device, starts = self.seqs, self.slot_mapping.device, self.query_start.tolist()
        short = [i for i, s in enumerate(seqs) if s.query_len <= SHORT_QUERY]
        groups = []
        if short:
            rows = (slice(0, starts[-1]) if len(short) == len(seqs) else torch.tensor(
                [starts[i] + j for i in short for j in range(seqs[i].query_len)],
                dtype=torch.long, device=device))
            groups.append(AttentionGroup.build([seqs[i] for i in short], rows, device))
        groups += [AttentionGroup.build([s], slice(starts[i], starts[i] + s.query_len), device)
                   for i, s in enumerate(seqs) if s.query_len > SHORT_QUERY]
        return groups


def slots_of(block_table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """The cache slots of a sequence's positions start, ..., stop - 1."""
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, stop)]


def gpu_kernel_fits(block_size: int) -> bool:
    """Whether the GPU's kernel (triton_paged) can read this cache: Triton is there and
    the blocks are a power of two of at least 16 keys (its tiles)."""
    return (triton_paged.triton_available() and block_size >= triton_paged.MIN_DOT
            and block_size & (block_size - 1) == 0)


def gpu_kernel_takes(seqs: list[SequenceSlice], block_size: int) -> bool:
    """Whether the GPU's kernel runs this step: it fits, and every query is short (a
    long prefill chunk attends better with SDPA's flash kernel, which reuses each key
    across rows)."""
    return gpu_kernel_fits(block_size) and all(s.query_len <= SHORT_QUERY for s in seqs)


def kv_cache_shapes(num_blocks: int, block_size: int, kv_heads: int,
                    head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One layer's (keys, values) cache shapes."""
    return (num_blocks, kv_heads, head_dim, block_size), (num_blocks * block_size, kv_heads,
                                                          head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, window: int | None, scale: float,
                    softcap: float = 0.0) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim]; caches as
    kv_cache_shapes gives; softcap > 0: scores become softcap * tanh(score / softcap)
    (Gemma 2). Returns [num_tokens, heads * head_dim]."""
    if meta.rows is not None:
        triton_paged.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return triton_paged.paged_attention(q, k_cache, v_cache, meta.block_tables,
                                            meta.context_lens, meta.rows[0], meta.rows[1],
                                            meta.tree_masks, window or 0, scale, softcap)
    if q.device.type == "cpu" and cpu_kernels_loaded():
        return torch.ops.outrider_cpu.paged_attention(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.query_start, meta.context_lens,
            meta.block_tables, meta.tree_masks, window or 0, scale, softcap)
    return reference_attention(q, k, v, k_cache, v_cache, meta, window, scale, softcap)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, window: int | None,
                        scale: float, softcap: float = 0.0) -> torch.Tensor:
    """paged_attention in torch ops: SDPA per group over gathered contexts."""
    block_size = meta.block_size
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    k_cache[blocks, :, :, offsets] = k  # [num_tokens, kv_heads, head_dim] into the blocks
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if len(meta.groups) == 1:
        return _attend(meta.groups[0], q, k, v, k_cache, v_cache, block_size, window, scale,
                       softcap)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in meta.groups:
        out[group.rows] = _attend(group, q[group.rows], k[group.rows], v[group.rows],
                                  k_cache, v_cache, block_size, window, scale, softcap)
    return out


def _attend(group: AttentionGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
            window: int | None, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One group's queries q [n, heads, head_dim] -> [n, heads * head_dim]."""
    batch, max_q = group.batch, group.max_query_len
    num_tokens, heads, head_dim = q.shape
    if group.pad_index is None:
        q_pad = q.view(batch, max_q, heads, head_dim)
    else:
        q_pad = q.new_zeros(batch * max_q, heads, head_dim).index_copy_(0, group.pad_index, q)
        q_pad = q_pad.view(batch, max_q, heads, head_dim)
    if group.is_plain_causal(window):
        out = _sdpa(  # [1, heads, q, head_dim]
            q_pad.transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
            v.unsqueeze(0).transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=k.shape[1] != heads, softcap=softcap)
        return out.transpose(1, 2).reshape(num_tokens, heads * head_dim)
    # keys: [batch, max_ctx, kv_heads, head_dim] from transposed blocks; values likewise
    keys = _gather_context(k_cache.transpose(1, 3).transpose(2, 3), group)
    values = _gather_context(v_cache.view(-1, block_size, *v_cache.shape[1:]), group)
    fold = heads // keys.shape[2]
    out = _grouped_sdpa(q_pad, keys, values, group.mask(window, fold, q.dtype), scale,
                        softcap)
    out = out.reshape(batch * max_q, heads * head_dim)
    return out if group.pad_index is None else out.index_select(0, group.pad_index)


def _grouped_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None, scale: float,
                  softcap: float = 0.0) -> torch.Tensor:
    """q [batch, max_q, heads, dim], keys/values [batch, ctx, kv_heads, dim], mask
    [batch, 1, group * max_q, ctx] additive or None -> [batch, max_q, heads, dim]. The
    query heads sharing a KV head are folded into its query rows (one SDPA head per KV
    head): the same arithmetic as grouped-query attention, without SDPA's slower GQA
    path."""
    batch, max_q, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    folded = (q.view(batch, max_q, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
              .reshape(batch, kv_heads, group * max_q, dim))  # rows: (head in group, query)
    out = _sdpa(folded, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                scale=scale, softcap=softcap)
    return out.view(batch, kv_heads, group, max_q, dim).permute(0, 3, 1, 2, 4)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          attn_mask: torch.Tensor | None = None, softcap: float = 0.0,
          **kwargs) -> torch.Tensor:
    """SDPA, on CPU in float64 rounded once to q's dtype. How SDPA blocks its loops
    depends on the padded shapes, so in float32 or bf16 a row's result moves with the
    batch around it; in float64 it moves by ~1e-16, which the rounding removes: rows come
    out as they would alone (the batch invariance greedy exactness relies on, which the
    C++ kernel has by construction), at some cost to a path that runs only without it."""
    attend = (functools.partial(soft_capped_sdpa, softcap=softcap) if softcap
              else F.scaled_dot_product_attention)
    if q.device.type != "cpu":
        return attend(q, k, v, attn_mask=attn_mask, **kwargs)
    mask = None if attn_mask is None else attn_mask.double()
    out = attend(q.double(), k.double(), v.double(), attn_mask=mask, **kwargs)
    return out.to(q.dtype)


def soft_capped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attn_mask: torch.Tensor | None, scale: float, softcap: float,
                     is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's arithmetic with the scores capped by softcap * tanh(score / softcap) before
    the mask and the softmax (SDPA has no such step). q [b, heads, n, d], k and v
    [b, kv_heads, m, d]."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale  # [b, heads, n, m]
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:  # the n queries are the last n of the m keys
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device)
                                    .triu(m - n + 1), float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.softmax(scores, dim=-1) @ v


def _gather_context(blocks: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """Each sequence's context [batch, max_ctx, kv_heads, head_dim] from blocks
    [num_blocks, block_size, kv_heads, head_dim], copied whole blocks at a time."""
    tables = group.block_tables
    gathered = blocks.index_select(0, tables.flatten())  # [batch * max_blocks, block, ...]
    gathered = gathered.reshape(tables.shape[0], -1, *blocks.shape[2:])
    return gathered[:, :group.max_context_len]
