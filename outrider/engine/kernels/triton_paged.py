"""Paged attention on a GPU in Triton: short queries (decode, verification of chains and
token trees) read the KV cache's blocks in place, as the CPU's C++ kernel does.

One program per (query row, KV head) computes the query heads that share that KV head
(grouped-query attention reads each key once for them all) with an online softmax over
the row's context, block by block. A row never looks at another row, so its result is
the same whatever batch it is in (the batch invariance greedy exactness relies on). Its
metadata are tensors only (no host-side loop), which is what lets a CUDA graph capture
it: a replay changes the rows by rewriting the buffers (engine/cuda_graphs.py).

Rows whose query slot is negative are padding (a graph's batch rounded up): their output
is zeros and they write no KV. Triton's interpreter (TRITON_INTERPRET=1) runs the same
kernels on CPU tensors, which is how the CPU suite holds them to the reference path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os

import torch

MIN_DOT = 16  # tl.dot's smallest side: the query heads of a group are padded up to it


DISABLE_ENV = "OUTRIDER_NO_TRITON"  # set to 1: the GPU attends by the reference path
log = logging.getLogger(__name__)
_failed: list[str] = []  # why the kernels did not run here (then nothing calls them)


@functools.cache
def triton_available() -> bool:
    return (os.environ.get(DISABLE_ENV) != "1" and not _failed
            and importlib.util.find_spec("triton") is not None)


def runs_here(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
              head_dim: int, block_size: int) -> bool:
    """Whether the kernels run for a model of these shapes on `device`: tried once on a
    tiny cache (Triton compiles its launcher with the machine's C compiler, and a GPU may
    lack an instruction a tile needs). A failure logs one line and turns them off in this
    process, so attention takes the reference path."""
    if not triton_available():
        return False
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            cache = [torch.zeros(shape, dtype=dtype, device=device) for shape in (
                (1, kv_heads, head_dim, block_size), (block_size, kv_heads, head_dim))]
            k = torch.zeros(1, kv_heads, head_dim, dtype=dtype, device=device)
            zero = torch.zeros(1, dtype=torch.int32, device=device)
            store_kv(k, k, *cache, zero.long())
            paged_attention(torch.zeros(1, heads, head_dim, dtype=dtype, device=device),
                            *cache, zero.view(1, 1), zero + 1, zero, zero, None, 0, 1.0, 0.0)
    except Exception as exc:  # noqa: BLE001 (any failure means: not here)
        _failed.append(f"{type(exc).__name__}: {(str(exc).strip() or '-').splitlines()[0]}")
        triton_available.cache_clear()
        log.warning("the GPU's Triton attention kernel does not run here (%s): attention "
                    "takes the reference path, and steps are not captured as CUDA graphs",
                    _failed[-1])
        return False
    return True


@functools.cache
def _kernels():
    """The jitted kernels, defined on first use (an install without Triton never imports it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv(k, v, k_cache, v_cache, slots,
                 k_row, k_head, v_row, v_head,
                 kc_block, kc_head, kc_dim, vc_slot, vc_head,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots + row)
        if slot >= 0:
            dims = tl.arange(0, DIM_PAD)
            real = dims < HEAD_DIM
            key = tl.load(k + row * k_row + head * k_head + dims, mask=real)
            value = tl.load(v + row * v_row + head * v_head + dims, mask=real)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(k_cache + block * kc_block + head * kc_head + dims * kc_dim + offset,
                     key, mask=real)
            tl.store(v_cache + slot * vc_slot + head * vc_head + dims, value, mask=real)

    @triton.jit
    def attend(q, out, k_cache, v_cache, block_tables, context_lens, row_seq, row_slot,
               tree_masks, q_row, q_head, out_row, kc_block, kc_head, kc_dim,
               vc_slot, vc_head, table_row, window, scale, softcap,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
               DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_TREE: tl.constexpr,
               PRECISION: tl.constexpr):
        row, kv_head = tl.program_id(0), tl.program_id(1)
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)      # [GROUP_PAD]
        is_head = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, DIM_PAD)
        is_dim = dims < HEAD_DIM
        out_ptrs = out + row * out_row + heads[:, None] * HEAD_DIM + dims[None, :]
        out_mask = is_head[:, None] & is_dim[None, :]
        query_slot = tl.load(row_slot + row)  # the query's index in its sequence
        if query_slot < 0:  # padding
            tl.store(out_ptrs, tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
                     .to(out.dtype.element_ty), mask=out_mask)
        else:
            seq = tl.load(row_seq + row)
            n_keys = tl.minimum(query_slot + 1, tl.load(context_lens + seq))
            # (one expression: a variable assigned in a runtime branch must keep its type)
            first = tl.where(window > 0, tl.maximum(query_slot - window + 1, 0), 0)
            tree = -1
            if HAS_TREE:
                tree = tl.load(tree_masks + row)
            queries = tl.load(q + row * q_row + heads[:, None] * q_head + dims[None, :],
                              mask=out_mask, other=0.0)                # [GROUP_PAD, DIM_PAD]
            best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
            offsets = tl.arange(0, BLOCK_SIZE)
            index = first // BLOCK_SIZE
            # (a while loop: Triton's interpreter cannot range over loaded bounds)
            while index < (n_keys + BLOCK_SIZE - 1) // BLOCK_SIZE:
                block = tl.load(block_tables + seq * table_row + index).to(tl.int64)
                keys = tl.load(k_cache + block * kc_block + kv_head * kc_head
                               + dims[:, None] * kc_dim + offsets[None, :],
                               mask=is_dim[:, None], other=0.0)        # [DIM_PAD, BLOCK_SIZE]
                values = tl.load(v_cache + (block * BLOCK_SIZE + offsets[:, None]) * vc_slot
                                 + kv_head * vc_head + dims[None, :],
                                 mask=is_dim[None, :], other=0.0)      # [BLOCK_SIZE, DIM_PAD]
                scores = tl.dot(queries, keys, input_precision=PRECISION) * scale
                if softcap > 0:  # softcap * tanh(s / softcap), tanh through exp
                    scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
                key_slot = index * BLOCK_SIZE + offsets                 # [BLOCK_SIZE]
                seen = (key_slot < n_keys) & (key_slot >= first)
                if HAS_TREE:  # bit d of the row's mask: the key d slots back is seen
                    back = query_slot - key_slot
                    bit = (tree >> tl.minimum(tl.maximum(back, 0), 63).to(tl.int64)) & 1
                    seen = seen & ((tree == -1) | (back >= 64) | (bit == 1))
                scores = tl.where(seen[None, :], scores, float("-inf"))
                new_best = tl.maximum(best, tl.max(scores, 1))
                # a row that has seen no key yet subtracts 0, not -inf (NaN)
                shift = tl.where(new_best == float("-inf"), 0.0, new_best)
                weights = tl.exp(scores - shift[:, None])               # [GROUP_PAD, BLOCK_SIZE]
                rescale = tl.exp(best - shift)
                total = total * rescale + tl.sum(weights, 1)
                acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values,
                                                      input_precision=PRECISION)
                best = new_best
                index += 1
            tl.store(out_ptrs, (acc / total[:, None]).to(out.dtype.element_ty), mask=out_mask)

    return store_kv, attend


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [rows, kv_heads, head_dim] into their slots [rows] (negative: none) of caches
    laid out as attention.kv_cache_shapes gives."""
    rows, kv_heads, head_dim = k.shape
    kernel, _ = _kernels()
    kernel[(rows, kv_heads)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), BLOCK_SIZE=k_cache.shape[3], HEAD_DIM=head_dim,
        DIM_PAD=_next_power_of_2(head_dim))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    row_seq: torch.Tensor, row_slot: torch.Tensor,
                    tree_masks: torch.Tensor | None, window: int, scale: float,
                    softcap: float) -> torch.Tensor:
    """q [rows, heads, head_dim]; each row's sequence (row_seq [rows]) and the query's
    index in it (row_slot [rows], negative: padding); block_tables [seqs, width],
    context_lens [seqs]; tree_masks [rows] (-1: causal) or None. The row's keys are
    written already (store_kv). Returns [rows, heads * head_dim]."""
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = q.new_empty(rows, heads * head_dim)
    _, kernel = _kernels()
    kernel[(rows, kv_heads)](
        q, out, k_cache, v_cache, block_tables, context_lens, row_seq, row_slot,
        row_slot if tree_masks is None else tree_masks, q.stride(0), q.stride(1),
        out.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), window, scale,
        softcap, GROUP=group, GROUP_PAD=max(MIN_DOT, _next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=max(MIN_DOT, _next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[3], HAS_TREE=tree_masks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
