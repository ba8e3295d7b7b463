"""Model-free drafting: proposals looked up in tokens already seen (docs/DESIGN.md §2.8).

Two kinds, both point masses (q is one-hot at the proposed token, §3):
  ngram   prompt lookup over the sequence's own tokens: the longest n-gram (n in
          [NGRAM_MIN, NGRAM_MAX]) that ends the context and occurred before (its most
          recent occurrence with γ tokens after it, else its earliest); it proposes the
          γ tokens that followed it.
  suffix  suffix matching over the sequence and a bounded corpus of recently finished
          sequences of this replica (prompt + output): the longest suffix of the context
          (up to MAX_MATCH tokens) found in either, the sequence's own occurrence winning
          a tie; it proposes what followed, at most SPEC_FACTOR × the match's length (a
          short match is weak evidence).
Costs: numpy over the candidate positions of the context's last token; measured per
round by `outrider bench --proposers` (BENCHMARKS.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from outrider.core.sequence import NGRAM_MAX, NGRAM_MIN

MAX_MATCH = 32         # suffix tokens compared at most
MIN_SUFFIX_MATCH = 2   # shorter matches propose nothing
SPEC_FACTOR = 2        # a suffix match of m tokens proposes at most 2m
CORPUS_TOKENS = 1 << 15  # tokens of finished sequences the suffix corpus keeps (~6 MB)
KEY_LEN = 2            # the corpus is indexed by its 2-grams (packed in one int) ...
HITS_PER_KEY = 16      # ... keeping each one's most recent positions


class Lookup(NamedTuple):
    """A lookup's proposal and the length of the context suffix it matched (how much
    evidence it has: longer matches are accepted more often)."""

    tokens: list[int]
    match_len: int = 0


def prompt_lookup(context: np.ndarray, max_tokens: int, min_n: int = NGRAM_MIN,
                  max_n: int = NGRAM_MAX) -> Lookup:
    """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the
    longest n-gram (min_n <= n <= max_n) ending `context` [L] int64."""
    ends, length = _suffix_matches(context, context[:-1], max_n)
    if not len(ends) or length.max() < min_n or max_tokens <= 0:
        return Lookup([])
    end = _pick(ends[length == length.max()], len(context), max_tokens)
    return Lookup(context[end + 1:end + 1 + max_tokens].tolist(), int(length.max()))


def _pick(ends: np.ndarray, context_len: int, wanted: int) -> int:
    """Of the end positions of equally long matches, the most recent with `wanted`
    tokens after it in the context, else the earliest (the most tokens after it): the
    most recent occurrence of a common phrase is often just behind the current position,
    with next to nothing after it."""
    enough = ends[context_len - 1 - ends >= wanted]
    return int(enough.max()) if len(enough) else int(ends.min())


def _suffix_matches(context: np.ndarray, text: np.ndarray, max_len: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(end positions in `text` [T] where the context's last token occurs, the length of
    the context suffix matched ending there, at most `max_len`), both [candidates]."""
    if len(context) == 0 or len(text) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ends = np.flatnonzero(text == context[-1])
    if not len(ends):
        return ends, ends
    back = np.arange(min(max_len, len(context)))                 # [n]
    at = ends[:, None] - back[None, :]                           # [candidates, n]
    same = (at >= 0) & (text[np.maximum(at, 0)] == context[len(context) - 1 - back][None, :])
    return ends, np.cumprod(same, axis=1).sum(axis=1)


class SuffixCorpus:
    """Recently finished sequences (at most `max_tokens` tokens in all, oldest dropped
    first), indexed by their KEY_LEN-grams for suffix matching."""

    def __init__(self, max_tokens: int = CORPUS_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._docs: OrderedDict[int, np.ndarray] = OrderedDict()  # id -> tokens [n]
        # a 2-gram (a << 32 | b) -> its newest positions (doc id << 32 | end), oldest
        # first: ints and plain lists, the smallest Python holds them in
        self._index: dict[int, list[int]] = {}
        self._next_id = 0

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= KEY_LEN or len(tokens) > self.max_tokens:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = np.asarray(tokens, dtype=np.int64)
        self.num_tokens += len(tokens)
        for end in range(KEY_LEN - 1, len(tokens) - 1):  # the last token has no follower
            hits = self._index.setdefault(tokens[end - 1] << 32 | tokens[end], [])
            hits.append(doc_id << 32 | end)
            if len(hits) > HITS_PER_KEY:
                del hits[0]
        while self.num_tokens > self.max_tokens:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        doc_id, doc = self._docs.popitem(last=False)
        self.num_tokens -= len(doc)
        tokens = doc.tolist()
        for end in range(KEY_LEN - 1, len(tokens) - 1):
            key = tokens[end - 1] << 32 | tokens[end]
            hits = self._index.get(key)
            if hits is None:
                continue
            hits[:] = [h for h in hits if h >> 32 != doc_id]
            if not hits:
                del self._index[key]

    def match(self, context: np.ndarray) -> tuple[int, np.ndarray]:
        """(length of the longest context suffix found, the tokens that followed it [k]);
        (0, []) when no KEY_LEN-gram suffix occurs."""
        if len(context) < KEY_LEN:
            return 0, context[:0]
        best_len, best = 0, context[:0]
        last = context[-KEY_LEN:].tolist()
        for hit in reversed(self._index.get(last[0] << 32 | last[1], ())):
            doc_id, end = hit >> 32, hit & 0xFFFFFFFF
            text = self._docs[doc_id]
            length = _match_back(context, text, end)
            if length > best_len:
                best_len, best = length, text[end + 1:]
        return best_len, best


def _match_back(context: np.ndarray, text: np.ndarray, end: int) -> int:
    """How many tokens ending `context` equal those ending at text[end] (<= MAX_MATCH),
    compared one by one from the end: matches are short, and a loop over them costs a
    third of numpy's calls over the whole window."""
    limit = min(MAX_MATCH, len(context), end + 1)
    last, length = len(context) - 1, 0
    while length < limit and text[end - length] == context[last - length]:
        length += 1
    return length


def suffix_lookup(context: np.ndarray, max_tokens: int, corpus: SuffixCorpus) -> Lookup:
    """Up to `max_tokens` tokens that followed the longest suffix of `context` [L] found
    in the context itself or in `corpus`, at most SPEC_FACTOR × its length."""
    ends, length = _suffix_matches(context, context[:-1], MAX_MATCH)
    own_len = int(length.max()) if len(length) else 0
    wanted = min(max_tokens, SPEC_FACTOR * own_len)
    own = (context[_pick(ends[length == own_len], len(context), wanted) + 1:] if own_len
           else context[:0])
    corpus_len, corpus_next = corpus.match(context)
    match_len, follow = (own_len, own) if own_len >= corpus_len else (corpus_len, corpus_next)
    if match_len < MIN_SUFFIX_MATCH or max_tokens <= 0:
        return Lookup([])
    return Lookup(follow[:min(max_tokens, SPEC_FACTOR * match_len)].tolist(), match_len)
