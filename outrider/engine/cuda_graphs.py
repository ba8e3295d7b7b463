"""A GPU step as a CUDA graph: the forward of short-query steps (decode, verification of
chains and trees, a draft's forwards) captured once per padded size at start, replayed.

Eager, a small model's step on a GPU is the host's: Python and one kernel launch per op,
4-8 ms whatever the batch (BENCHMARKS §8). A graph replays the step's few hundred kernels
in one launch. What changes between steps lives in static buffers the graph reads: the
tokens, positions, cache slots, tree masks, each row's sequence and query slot, context
lengths and block tables. A step of N tokens is padded up to the nearest size captured
(SIZES): padded rows write no KV and attend to nothing (the Triton kernel's negative
query slot), and their logits are dropped. Steps outside the ladder (a long prefill
chunk, a head that reads hidden states) run eagerly.

`capture=False` runs the same padded static-buffer step without graphs: how the CPU
suite holds the bookkeeping to the eager forward (Triton's interpreter, no CUDA).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from outrider.engine.attention import SHORT_QUERY, AttentionMetadata, slots_of

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
# the static buffer's segments, each as long as the largest size: one copy a step fills them
FIELDS = ("input_ids", "positions", "slots", "trees", "row_seq", "row_slot", "context_lens",
          "logits_rows")
PADDING = {"slots": -1, "trees": -1, "row_slot": -1}  # a padded row writes and reads nothing


class GraphedSteps:
    """Replays `forward(input_ids, positions, kv_caches, meta, logits_rows)` from CUDA
    graphs for steps of at most `max_tokens` tokens, each sequence's query at most
    SHORT_QUERY long."""

    def __init__(self, forward: Callable, kv_caches: list, block_size: int, max_blocks: int,
                 device: torch.device, max_tokens: int = SIZES[-1], capture: bool = True
                 ) -> None:
        self.forward, self.kv_caches, self.block_size = forward, kv_caches, block_size
        self.device, self.capture = device, capture
        self.sizes = [s for s in SIZES if s <= max_tokens]
        largest = self.sizes[-1]
        self.buffer = torch.zeros(len(FIELDS), largest, dtype=torch.long, device=device)
        for name, value in PADDING.items():
            self.field(name).fill_(value)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # [largest, vocab] fp32: every graph writes its logits here (one buffer, not one
        # per size kept alive: 2,247 rows of a 128k vocabulary would be 1.1 GB)
        self.logits: torch.Tensor | None = None
        self.capture_s = 0.0

    def field(self, name: str, size: int | None = None) -> torch.Tensor:
        return self.buffer[FIELDS.index(name), :size]

    def meta(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows reads: views of the static buffers."""
        rows = self.buffer[FIELDS.index("row_seq"):FIELDS.index("row_slot") + 1, :size]
        return AttentionMetadata([], self.field("slots", size), None,
                                 self.field("context_lens", size), self.block_tables[:size],
                                 self.block_size, self.field("trees", size), rows)

    def _run(self, size: int) -> torch.Tensor:
        """One eager forward of the static buffers' first `size` rows -> [size, vocab]."""
        return self.forward(self.field("input_ids", size), self.field("positions", size),
                            self.kv_caches, self.meta(size), torch.arange(size, device=self.device))

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every size, largest first (the smaller ones reuse its memory pool).
        Returns the seconds it took."""
        start = time.perf_counter()
        if not self.capture:
            return 0.0
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks kernels
                warm = self._run(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self.logits is None:
                self.logits = torch.empty_like(warm)
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(self._run(size))
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d CUDA graphs (1-%d tokens) in %.1f s", len(self.sizes),
                 self.sizes[-1], self.capture_s)
        return self.capture_s

    def size_for(self, requests: list) -> int | None:
        """The graph a step of `requests` (runner.ForwardRequest) replays: its size, or
        None where the step runs eagerly."""
        tokens = sum(len(r.token_ids) for r in requests)
        if 0 < tokens <= self.sizes[-1] and all(
                0 < len(r.token_ids) <= SHORT_QUERY and r.features is None
                and len(r.block_table) <= self.block_tables.shape[1] for r in requests):
            return next(s for s in self.sizes if s >= tokens)
        return None

    def __call__(self, requests: list, size: int) -> torch.Tensor:
        """The step's logits [sum(num_logits), vocab] in fp32, from the graph of `size`
        (size_for)."""
        self._fill(requests, size)
        logits_rows = self.field("logits_rows", sum(r.num_logits for r in requests))
        if not self.capture:
            return self._run(size).index_select(0, logits_rows)
        self.graphs[size].replay()
        return self.logits.index_select(0, logits_rows)  # a copy: the next replay overwrites

    def _fill(self, requests: list, size: int) -> None:
        """Write the step into the static buffers' first `size` rows (rows past its tokens
        padding), in two host-to-device copies."""
        columns: dict[str, list[int]] = {name: [] for name in FIELDS}
        offset, width = 0, max(len(r.block_table) for r in requests)
        for i, r in enumerate(requests):
            n = len(r.token_ids)
            columns["input_ids"] += r.token_ids
            offsets = range(n) if r.tree is None else r.tree[0]
            columns["positions"] += [r.cached_len + o for o in offsets]
            columns["slots"] += slots_of(r.block_table, r.cached_len, r.cached_len + n,
                                         self.block_size)
            columns["trees"] += [-1] * n if r.tree is None else r.tree[1]
            columns["row_seq"] += [i] * n
            columns["row_slot"] += range(r.cached_len, r.cached_len + n)
            columns["context_lens"].append(r.cached_len + n)
            columns["logits_rows"] += range(offset + n - r.num_logits, offset + n)
            offset += n
        host = torch.tensor([col + [PADDING.get(name, 0)] * (size - len(col))
                             for name, col in columns.items()], dtype=torch.long)
        self.buffer[:, :size].copy_(host)
        tables = torch.tensor([r.block_table + [0] * (width - len(r.block_table))
                               for r in requests], dtype=torch.int32)
        self.block_tables[:len(requests), :width].copy_(tables)
