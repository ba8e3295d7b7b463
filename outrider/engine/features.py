"""The target's hidden states that a draft head reads (docs/DESIGN.md §8.8): which ones
(`FeatureTap`), and those of each sequence's committed positions until its head takes
them (`FeatureLog`).

A head drafts for the position after p from the target's feature at p and the token at
p + 1 (EAGLE's pairing), so a committed token travels with the feature of the position
before it: row i of a DraftItem's features goes with its new_token_ids[i], and the
sequence's first token has none (a zero row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FeatureTap:
    """What the target keeps of every position it processes for a head: the residual
    stream entering each of `layers` (the number of layers: the last one's output),
    concatenated in layer order (EAGLE-3); or, `normed`, the final normed hidden state
    (EAGLE-1). `fuse`: the head's fc, applied as the target keeps them — what the head
    computes first anyway, so the log, the prefix cache and the wire hold one hidden
    vector a position where the taps are three."""

    layers: tuple[int, ...] = ()
    normed: bool = False
    fuse: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    fused_width: int = 0  # fuse's output width

    def width(self, hidden_size: int) -> int:
        if self.fuse is not None:
            return self.fused_width
        return hidden_size if self.normed else hidden_size * len(self.layers)

    def keep(self, taps: torch.Tensor) -> torch.Tensor:
        """[n, taps] -> [n, width]: what the target keeps of a forward's positions."""
        return taps if self.fuse is None else self.fuse(taps)


class FeatureLog:
    """Each sequence's features of committed positions its head does not hold yet, as
    chunks (a step adds one; nothing is copied until a Propose asks)."""

    def __init__(self) -> None:
        # seq -> (first position, chunks of rows [n_i, width], in order)
        self._logs: dict[object, tuple[int, list[torch.Tensor]]] = {}

    def add(self, seq_id, start: int, rows: torch.Tensor) -> None:
        """The features of positions start, start + 1, ...; recomputed ones (a preempted
        sequence, maybe chunk by chunk) replace what the log held there."""
        first, chunks = self._logs.get(seq_id, (start, []))
        end = first + sum(len(c) for c in chunks)
        if start > end or start + len(rows) < first:  # a gap: the older rows are no use
            first, chunks = start, []
        kept = _rows(chunks, first, first, start)  # before the new rows
        after = _rows(chunks, first, start + len(rows), end)  # past them (a recompute)
        self._logs[seq_id] = (min(first, start), [*kept, rows, *after])

    def rows_for(self, seq_id, first_token: int, num_tokens: int) -> torch.Tensor | None:
        """The features that go with tokens first_token .. first_token + num_tokens - 1
        ([num_tokens, width]; a zero row for token 0); None when the log lacks some (the
        head cannot draft for this sequence now)."""
        if not self.covers(seq_id, first_token, num_tokens):
            return None
        first, chunks = self._logs[seq_id]
        start, end = first_token - 1, first_token - 1 + num_tokens  # positions
        lead = max(0, -start)  # token 0 has no position before it
        rows = torch.cat(_rows(chunks, first, start + lead, end))
        if lead:
            rows = torch.cat([rows.new_zeros(lead, rows.shape[1]), rows])
        return rows

    def covers(self, seq_id, first_token: int, num_tokens: int) -> bool:
        """Whether it holds the features of those tokens (rows_for, without the copy)."""
        if seq_id not in self._logs:
            return False
        first, chunks = self._logs[seq_id]
        start = max(0, first_token - 1)
        return first <= start and first_token - 1 + num_tokens <= first + sum(map(len, chunks))

    def taken(self, seq_id, num_tokens: int) -> None:
        """The head holds the sequence's first `num_tokens` tokens: it will not need the
        features of positions before num_tokens - 1 again."""
        if seq_id in self._logs:
            first, chunks = self._logs[seq_id]
            cut = max(first, num_tokens - 1)
            end = first + sum(len(c) for c in chunks)
            self._logs[seq_id] = (min(cut, end), _rows(chunks, first, cut, end))

    def drop(self, seq_id) -> None:
        self._logs.pop(seq_id, None)


def _rows(chunks: list[torch.Tensor], first: int, start: int, end: int) -> list[torch.Tensor]:
    """The parts of `chunks` (positions from `first`) that hold positions [start, end)."""
    out, position = [], first
    for chunk in chunks:
        lo, hi = max(start, position), min(end, position + len(chunk))
        if lo < hi:
            out.append(chunk[lo - position:hi - position])
        position += len(chunk)
    return out
