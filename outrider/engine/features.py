"""The target's hidden states that a draft head reads (docs/DESIGN.md §8.8): which ones
(`FeatureTap`), and those of each sequence's committed positions until its head takes
them (`FeatureLog`).

A head drafts for the position after p from the target's feature at p and the token at
p + 1 (EAGLE's pairing), so a committed token travels with the feature of the position
before it: row i of a DraftItem's features goes with its new_token_ids[i], and the
sequence's first token has none (a zero row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FeatureTap:
    """What the target keeps of every position it processes for a head: the residual
    stream entering each of `layers` (the number of layers: the last one's output),
    concatenated in layer order (EAGLE-3); or, `normed`, the final normed hidden state
    (EAGLE-1)."""

    layers: tuple[int, ...] = ()
    normed: bool = False

    def width(self, hidden_size: int) -> int:
        return hidden_size if self.normed else hidden_size * len(self.layers)


class FeatureLog:
    """Each sequence's features of committed positions its head has not taken yet."""

    def __init__(self) -> None:
        self._logs: dict[object, tuple[int, torch.Tensor]] = {}  # seq -> (first position,
        #                                                         rows [n, width])

    def add(self, seq_id, start: int, rows: torch.Tensor) -> None:
        """The features of positions start, start + 1, ... (recomputed ones replace what
        the log held from `start` on)."""
        first, held = self._logs.get(seq_id, (start, rows[:0]))
        if not first <= start <= first + len(held):  # a gap: the older rows are no use
            first, held = start, rows[:0]
        self._logs[seq_id] = (first, torch.cat([held[:start - first], rows]))

    def rows_for(self, seq_id, first_token: int, num_tokens: int) -> torch.Tensor | None:
        """The features that go with tokens first_token .. first_token + num_tokens - 1
        ([num_tokens, width]; a zero row for token 0); None when the log lacks some (the
        head cannot draft for this sequence now)."""
        if seq_id not in self._logs:
            return None
        first, held = self._logs[seq_id]
        start, end = first_token - 1, first_token - 1 + num_tokens  # positions
        lead = max(0, -start)  # token 0 has no position before it
        if start + lead < first or end > first + len(held):
            return None
        rows = held[start + lead - first:end - first]
        if lead:
            rows = torch.cat([rows.new_zeros(lead, rows.shape[1]), rows])
        return rows

    def taken(self, seq_id, num_tokens: int) -> None:
        """The head holds the sequence's first `num_tokens` tokens: it will not need the
        features of positions before num_tokens - 1 again."""
        if seq_id in self._logs:
            first, held = self._logs[seq_id]
            cut = min(len(held), max(0, num_tokens - 1 - first))
            self._logs[seq_id] = (first + cut, held[cut:])

    def drop(self, seq_id) -> None:
        self._logs.pop(seq_id, None)
