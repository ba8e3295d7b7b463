"""The speculation cache (docs/DESIGN.md §2.6): while the target verifies a round, the
draft replica drafts the next one for the outcomes verification likely has, so that
the next Propose finds its drafts ready instead of waiting for the draft's γ forwards.

A round that proposed d1..dg for a context c ends in one of these outcomes: the target
keeps d1..dk and adds one token t of its own (k < g: t replaces the rejected d_k+1; k = g:
t is the bonus token). Each likely outcome becomes a *stand-in*: a sequence of the
draft's whose context is c + d1..dk + t, drafted through the Drafter's ordinary path in
one batch with the others (its prefix comes from the draft's prefix cache: only the
last unsealed positions and the outcome are fed). The next Propose brings the outcome
that happened as its new tokens; if a stand-in holds it, the stand-in becomes the
sequence (Drafter.take_over) and its drafts are the answer.

Which outcomes, in the order of their estimated likelihood, up to MAX_ROWS stand-ins in
all: k = g with t the draft's own next token (it drafts g + 1 and the first is its guess
of the bonus), then for each k < g the draft's likeliest token other than d_k+1 (the
target took something else there). Likelihoods from the draft's acceptance α as the
target reported it (Drafter.live_acceptance): α^g for k = g, α^k (1 - α) / 2 for k < g.
A sequence that asked for ready drafts only (DraftItem.ready_only) and missed proposed
nothing: the target decodes one token t after its context c, and its one stand-in, c
drafted g + 1 deep, guesses t; it goes first.

Exact by construction: a hit answers with drafts the draft model sampled from the very
context the target committed, at the same absolute positions and seeds, with the q it
sampled them from; verification (exact for any proposal) does the rest. Their KV was
computed in one prefill chunk rather than position by position, so the logits move by
~1e-6 as any batch's shapes move them (§3.6).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from outrider.engine.drafter import Drafter, is_tree
from outrider.engine.proposer import DraftItem

MAX_ROWS = 16  # stand-ins drafted per round, every sequence of the Propose together
FAN_OUT = 3  # the draft's likeliest tokens tried where the target rejects a draft
GUESS_ODDS = 0.5  # how often a runner-up is the token the target takes instead (a guess;
#                   each next one half as often)


@dataclass
class Entry:
    """A stand-in's drafts for one outcome."""

    stand_in: str
    drafts: list[int]
    q: torch.Tensor | None  # [len(drafts), vocab] as sent; None: point masses
    q_format: str
    rank: int               # its outcome's, among the sequence's, likeliest first (1)


@dataclass
class _Plan:
    item: DraftItem         # the stand-in's, drafted as a whole context
    seq_id: str
    outcome: tuple[int, ...]  # the outcome's committed tokens (k = g: t comes with the drafts)
    bonus_drafted: bool     # k = g: the first draft is the guess of t
    likelihood: float
    context: list[int]      # the committed tokens before the outcome
    depth: int              # the drafts the round proposed (0: none, a ready-only miss)
    rank: int = 0


class SpeculationCache:
    """A draft replica's stand-ins, by the sequence they stand in for."""

    def __init__(self, drafter: Drafter, max_rows: int = MAX_ROWS,
                 sampled_weight: float | None = None,
                 on_lookup: Callable[[int, bool], None] | None = None) -> None:
        """sampled_weight: sampled rows are prepared for too, drafted with cache-aware
        sampling at this weight (Drafter._cache_aware; 1.0: q as it is). on_lookup(k, hit):
        a prepared sequence's next round was looked up; k: the drafts its outcome kept
        (-1: what it brought does not follow the context it was prepared for)."""
        self.drafter = drafter
        self.max_rows = max_rows
        self.sampled = sampled_weight is not None
        drafter.runners_up = FAN_OUT
        if self.sampled:
            drafter.aware_weight, drafter.aware_of = sampled_weight, self._cacheable
        # seq_id -> (its committed tokens at the last Propose, outcome -> entry, the drafts
        # that Propose proposed: an outcome keeps at most that many)
        self._entries: dict[str, tuple[list[int], dict[tuple[int, ...], Entry], int]] = {}
        self._next_id = 0
        self.hits = self.misses = 0
        self.on_lookup = on_lookup

    # -- the next Propose -----------------------------------------------------------------
    def take(self, items: list[DraftItem]) -> list[Entry | None]:
        """Per item, the entry of the outcome it brings, its stand-in now the sequence
        (None: a miss); every other stand-in of these sequences goes."""
        found = []
        for it in items:
            if it.collects:  # (it takes nothing: its entries are delivered as they are)
                found.append(None)
                continue
            context, entries, depth = self._entries.pop(it.seq_id, (None, {}, 0))
            outcome = self._outcome(it, context)
            entry = entries.get(outcome) if outcome else None
            if entry is not None and self._takes(it, entry):
                del entries[outcome]
            else:
                entry = None
            for other in entries.values():
                self.drafter.release(other.stand_in, served=False)
            if context is not None and it.gamma:
                self.hits += entry is not None
                self.misses += entry is None
                if self.on_lookup is not None:  # (tokens past depth + 1: not one round's)
                    self.on_lookup(len(outcome) - 1 if 0 < len(outcome) <= depth + 1 else -1,
                                   entry is not None)
            found.append(entry)
        return found

    def _outcome(self, item: DraftItem, context: list[int] | None) -> tuple[int, ...]:
        """The tokens committed after `context` that `item` brings (the drafts the target
        kept, which the draft holds already and the item's committed_len counts, then its
        new tokens); () when what it brings does not extend `context`. The draft's tokens
        agree with `context` as far as both go (each Propose or Release drops the
        sequence's entries): only the tokens after that are compared, not the context."""
        held = self.drafter.token_ids.get(item.seq_id, [])
        if context is None or item.committed_len > len(held):
            return ()
        start = min(item.committed_len, len(context))
        after = held[start:item.committed_len] + item.new_token_ids  # from position start
        if start + len(after) <= len(context) or after[:len(context) - start] != context[start:]:
            return ()
        return tuple(after[len(context) - start:])

    def _takes(self, item: DraftItem, entry: Entry) -> bool:
        if (not 0 < item.gamma <= len(entry.drafts) or item.q_format != entry.q_format
                or item.teacher):
            return False
        entry.drafts = entry.drafts[:item.gamma]
        entry.q = None if entry.q is None else entry.q[:item.gamma]
        return self.drafter.take_over(item, entry.stand_in, entry.drafts)

    def prepared(self, seq_id: str) -> list[tuple[tuple[int, ...], Entry]]:
        """The sequence's entries to deliver: (outcome, entry), likeliest first; point
        masses only (a sampled row's q would have to travel too)."""
        entries = self._entries.get(seq_id, (None, {}, 0))[1]
        return sorted(((o, e) for o, e in entries.items() if e.q is None),
                      key=lambda oe: oe[1].rank)

    def forget(self, seq_ids) -> None:
        """Released sequences: their stand-ins go too."""
        for seq_id in seq_ids:
            for entry in self._entries.pop(seq_id, (0, {}, 0))[1].values():
                self.drafter.release(entry.stand_in, served=False)

    # -- while the target verifies --------------------------------------------------------
    def plan(self, items: list[DraftItem], token_ids: list[list[int]]) -> list[_Plan]:
        """The stand-ins worth drafting after a Propose that proposed `token_ids` (per
        item), likeliest first, at most max_rows."""
        counts = self.drafter.live_acceptance.get(self.drafter.version, [0, 0])
        alpha = counts[1] / counts[0] if counts[0] else 0.5
        plans = []
        for it, drafts in zip(items, token_ids):
            if not (it.prepare and self._cacheable(it)):
                continue
            if 0 < len(drafts) == it.gamma and it.seq_id in self.drafter.likeliest:
                plans += self._outcomes(it, drafts, alpha)
            elif it.ready_only and not drafts and self.drafter.holds(it):
                plans.append(self._undrafted(it))
        plans.sort(key=lambda p: -p.likelihood)
        plans = plans[:self.max_rows]
        ranks: dict[str, int] = {}
        for p in plans:
            p.rank = ranks[p.seq_id] = ranks.get(p.seq_id, 0) + 1
        return plans

    def _cacheable(self, item: DraftItem) -> bool:
        """A greedy chain of a draft model, for a request with nothing else riding on the
        sequence's state (a grammar's, a teacher's, a dense channel's). Sampled rows
        only when asked: the token the target draws where it rejects comes from the
        residual max(0, p - q), which the draft's likeliest tokens rarely hold unless
        its sampling is cache-aware (measured: 13 % hits at T 0.7 against 95 % greedy)."""
        return (item.gamma > 0 and not item.prefill_only
                and (self.sampled or item.params.is_greedy)
                and not is_tree(item) and item.features is None and not item.teacher
                and item.params.structured_output is None and item.q_format != "dense_dist")

    def _undrafted(self, item: DraftItem) -> _Plan:
        """A ready-only sequence that missed: the target decodes one token after its
        context, which the draft has not taken in (it holds committed_len of it)."""
        held = self.drafter.token_ids.get(item.seq_id, [])
        if item.committed_len:
            self.drafter.runner.blocks.seal(item.seq_id, held, item.committed_len)
        context = held[:item.committed_len] + item.new_token_ids
        return self._plan(item, context, (), True, 1.0, depth=0)

    def _outcomes(self, item: DraftItem, drafts: list[int], alpha: float) -> list[_Plan]:
        context = self.drafter.token_ids[item.seq_id][:item.committed_len
                                                      + len(item.new_token_ids)]
        likeliest = self.drafter.likeliest[item.seq_id]
        g = len(drafts)
        # its committed tokens are final: sealed, the stand-ins take them from the cache
        self.drafter.runner.blocks.seal(item.seq_id, self.drafter.token_ids[item.seq_id],
                                        len(context))
        plans = [self._plan(item, context, tuple(drafts), True, alpha ** g, g)]
        for k in range(g):
            others = [t for t in likeliest[k] if t != drafts[k]][:FAN_OUT]
            plans += [self._plan(item, context, (*drafts[:k], t), False,
                                 alpha ** k * (1 - alpha) * GUESS_ODDS ** (rank + 1), g)
                      for rank, t in enumerate(others)]
        return plans

    def _plan(self, item: DraftItem, context: list[int], outcome: tuple[int, ...],
              bonus_drafted: bool, likelihood: float, depth: int) -> _Plan:
        self._next_id += 1
        stand_in = replace(item, seq_id=f"{item.seq_id}\x00{self._next_id}", committed_len=0,
                           new_token_ids=context + list(outcome), traceparent="",
                           gamma=item.gamma + bonus_drafted, ready_only=False)
        return _Plan(stand_in, item.seq_id, outcome, bonus_drafted, likelihood, context, depth)

    def fill(self, plans: list[_Plan], interrupted: Callable[[], bool] | None = None) -> int:
        """Draft the stand-ins (the caller holds the forward lock) and keep what they
        drafted, until `interrupted` (a Propose waits); returns how many were drafted. A
        stand-in never evicts a sequence."""
        if not plans:
            return 0
        evicts, self.drafter.evict_lru = self.drafter.evict_lru, False
        try:
            out = self.drafter.draft([p.item for p in plans], interrupted=interrupted)
        finally:
            self.drafter.evict_lru = evicts
        for i, p in enumerate(plans):
            g = out.gammas[i]
            drafts = out.token_ids[i, :g].tolist()
            q = None if out.probs is None else out.probs[i, :g]
            outcome = p.outcome
            if p.bonus_drafted and drafts:  # its first draft is the guess of t
                outcome, drafts, q = (*outcome, drafts[0]), drafts[1:], None if q is None else q[1:]
                likeliest = self.drafter.likeliest
                likeliest[p.item.seq_id] = likeliest.get(p.item.seq_id, [])[1:]
            if out.is_miss[i] or not drafts:
                self.drafter.release(p.item.seq_id, served=False)
                continue
            entries = self._entries.setdefault(p.seq_id, (p.context, {}, p.depth))[1]
            stale = entries.pop(outcome, None)
            if stale is not None:
                self.drafter.release(stale.stand_in, served=False)
            entries[outcome] = Entry(p.item.seq_id, drafts, q, p.item.q_format, p.rank)
            self.drafter.expendable.add(p.item.seq_id)  # the first to go for a sequence
        return len(plans)
