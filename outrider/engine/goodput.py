"""Choices the speculative loop makes step by step by expected goodput (tokens a second),
from what its own steps measured: whether greedy requests draft trees (tree.TreeChoice)
and what a Propose does with the sequences a speculation cache misses (CacheMissChoice)."""

from __future__ import annotations

from collections.abc import Callable


class Trials:
    """When a measured choice runs its losing option anyway, so that option's figures
    follow the load and the text: after 8 steps, then twice as long each time it loses
    again (up to 128), from 8 again when the lead changes."""

    FIRST, LAST = 8, 128  # steps between tries of the loser

    def __init__(self) -> None:
        self.left = self.wait = self.FIRST
        self.leader: bool | None = None

    def pick(self, best: bool) -> bool:
        """`best` most steps, the other now and then."""
        if self.leader != best:
            self.left = self.wait = self.FIRST
            self.leader = best
        self.left -= 1
        if self.left > 0:
            return best
        self.wait = min(2 * self.wait, self.LAST)
        self.left = self.wait
        return not best


# the share of sequences asking whose drafts a speculation cache had ready below which it
# does not pay: the target's verification keeps every core (SpeculativeDecoder.
# _draft_beside) and a Propose waits for its misses (CacheMissChoice); AUTO's lookups lead
# most greedy rounds, and ~10 % hit
CACHE_PAYS = 0.5
GATE_AFTER = 32  # Proposes measured before a cache that does not pay stops preparing


def ewma(old: float | None, new: float, weight: float = 0.1) -> float:
    return new if old is None else old + weight * (new - old)


class CacheMissChoice:
    """Whether a step's Proposes ask for ready drafts only (DraftItem.ready_only: a
    sequence the draft replica's speculation cache misses verifies no drafts this round)
    or wait while the misses are drafted. Waiting costs the whole batch the misses'
    drafting, whenever any of its B sequences misses (1 - h^B, h the hit rate); not
    waiting costs each missed sequence the drafts a round keeps. Priced with the replica's
    cost model (`verify_seconds`) and the Propose waits measured either way; until both
    are known, or while fewer than CACHE_PAYS of the sequences hit (one slow Propose,
    a context resent whole, had a first request at one stream left out 44 of its 71
    rounds), it waits as without a cache."""

    def __init__(self) -> None:
        self.hit_rate: float | None = None  # of the sequences a Propose asked drafts for
        self.observed = 0  # Proposes it is the mean of, until the EWMA's own weight
        self.kept: float | None = None      # drafts a round keeps
        # the step's wait for its Proposes: asking for ready drafts only, and waiting for
        # a Propose some sequence missed in
        self.ready_wait_s: float | None = None
        self.miss_wait_s: float | None = None
        self.trials = Trials()
        self.preparing = Trials()

    def prepares(self) -> bool:
        """Whether a step's Proposes have the replica prepare their sequences' next rounds:
        while the cache pays (CACHE_PAYS, or before GATE_AFTER Proposes measured it: the
        first rounds of a batch hit less), else now and then
        (Trials), so that the hit rate is measured again. Stand-ins nobody takes cost the
        verification they are drafted beside (under AUTO, where lookups lead most greedy
        rounds: 0.6-0.85x served)."""
        return (self.observed < GATE_AFTER or self.hit_rate >= CACHE_PAYS
                or self.preparing.pick(False))

    def observe(self, ready_only: bool, rows: int, hits: int, wait_s: float) -> None:
        """A step's Propose: `rows` sequences asked for drafts whose last Propose had the
        replica prepare them, `hits` of them cached."""
        if not rows:
            return
        # (the mean of the first ten: the first Proposes of a sequence, its context just
        # taken in, hit less; an EWMA that started there gated the cache off for good)
        self.observed += 1
        self.hit_rate = ewma(self.hit_rate, hits / rows, max(0.1, 1 / self.observed))
        if ready_only:
            self.ready_wait_s = ewma(self.ready_wait_s, wait_s)
        elif hits < rows:
            self.miss_wait_s = ewma(self.miss_wait_s, wait_s)

    def observe_kept(self, kept: int) -> None:
        self.kept = ewma(self.kept, kept)

    def ready_only(self, rows: int, gamma: int, verify_seconds: Callable[[int], float]) -> bool:
        """For `rows` sequences asking for γ drafts each."""
        if (self.hit_rate is None or self.hit_rate < CACHE_PAYS or self.kept is None
                or self.miss_wait_s is None):
            return False  # (a rarely hit cache leaves misses nothing: wait, as without one)
        if self.ready_wait_s is None:
            return True  # measure it once
        h, kept, wait = self.hit_rate, self.kept, self.ready_wait_s
        waited = rows * (1 + kept) / (verify_seconds(rows * (1 + gamma)) + wait
                                      + (1 - h ** rows) * max(0.0, self.miss_wait_s - wait))
        hits = rows * h
        ready = (hits * (1 + kept) + rows - hits) / (
            verify_seconds(round(hits * (1 + gamma) + rows - hits)) + wait)
        return self.trials.pick(ready > waited)
