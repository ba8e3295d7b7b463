"""Lookahead decoding's proposals without a draft (Fu et al., 2024; docs/DESIGN.md §2.8),
in the form the one verification forward gives for free.

Lookahead runs Jacobi iterations: guesses for the positions after the text, each
refined by the target's own prediction there. Every verification already computes them:
its rows past a round's committed tokens predict the positions that follow, beside a
draft it rejected (SpeculativeDecoder._note_guesses hands the target's own tokens there
back with the sequence's next item, DraftItem.guesses: the argmax, or for a sampled
request its draw with the uniforms the target samples those positions with). Those
guesses are the next round's proposal, which verification keeps or refines again; and
the n-grams along each trajectory are pooled by the token they follow, so that once the
text reaches a guessed token — a round kept all its drafts and left no guesses — the
pool proposes what the target guessed after it. The request's own n-gram lookup goes
first where it matches: what the text itself did after the same tokens is better
evidence than a guess. All are point masses: verification keeps each with the target's
probability (§3.2), exact.

Not the paper's separate 2-D lookahead branch of W × (N - 1) positions beside the
verification branch: here the verification branch is the window, so a round costs no
position beyond its γ, and guesses refine only as far as γ reaches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from outrider.core.sequence import NGRAM_SIZES
from outrider.engine.lookup import Lookup, prompt_lookup

NGRAM = 4           # pool entries: the N - 1 tokens guessed after a token
POOL_ENTRIES = 512  # per sequence, least recently used dropped
# the match length a proposal counts as, for the acceptance AUTO and the γ policy learn
# per match length (mix._Acceptance): a guess, from the pool or fresh, matched one token
GUESS_MATCH = 1


@dataclass
class Lookahead:
    """One sequence's window of guesses and its pool of n-grams."""

    pool: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)

    def propose(self, context: list[int], guesses: list[int], gamma: int,
                ngram_sizes: tuple[int, int] = NGRAM_SIZES) -> Lookup:
        """Up to γ tokens to follow `context` (the text now), and the match length they
        count as; `guesses`: the target's for the positions after it, pooled;
        `ngram_sizes`: the text's own n-gram lookup's (lookup.prompt_lookup)."""
        trajectory = context[-1:] + list(guesses)
        for k in range(len(trajectory) - 1):  # each guess's followers, by the token before
            self._pool(trajectory[k], trajectory[k + 1:k + NGRAM])
        looked_up = prompt_lookup(np.asarray(context, dtype=np.int64), gamma, *ngram_sizes)
        if looked_up.tokens:  # the text's own continuation: better evidence than a guess
            return looked_up
        if guesses:
            return Lookup(list(guesses[:gamma]), GUESS_MATCH)
        return Lookup(list(self.pool.get(context[-1], [])[:gamma]), GUESS_MATCH)

    def _pool(self, first: int, followers: list[int]) -> None:
        self.pool[first] = followers
        self.pool.move_to_end(first)
        if len(self.pool) > POOL_ENTRIES:
            self.pool.popitem(last=False)
