"""Drafts with a tokenizer of their own (docs/DESIGN.md §2.9): a draft model whose
vocabulary is not the target's proposes through text.

Each round the target's committed tokens become bytes and the bytes the draft's tokens
(re-encoded from the last place both tokenizations agree, not from the start). Greedy
rows: the draft drafts text in its vocabulary, which becomes the target's tokens again,
proposed as point masses (q = one-hot), as the n-gram lookups' are: verification keeps
exactly the target's argmax. Sampled rows: the draft samples only tokens whose bytes are
one target token (token-level intersection), so each draft is a target token and its q
moves over to the target's ids unchanged: rejection sampling is exact for the q a token
was drawn from.

Where the two tokenizations cut the text differently nothing is lost or duplicated: the
draft's context is the committed text up to its last whole UTF-8 character, and the
drafted text is re-encoded together with the target's last committed token, its
proposals the tokens after that one (when the target's tokenizer would merge across the
committed boundary, the drafted text is encoded alone: tokens the target's tokenizer
would not have chosen, still exact); the last proposed token, which more text could
change, is dropped unless the draft ended its text.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

import torch

from outrider.core.sampling import SamplingParams
from outrider.core.stats import CROSS_VOCAB_METHOD
from outrider.core.tokenizer import Tokenizer, TokenizerError, shares_vocabulary
from outrider.engine.drafter import Drafter
from outrider.engine.features import FeatureTap
from outrider.engine.model_config import ModelConfig
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal
from outrider.engine.spec_decode import RequestError

_SURROGATES = re.compile("([\udc80-\udcff]+)")
SETTLED = 8  # draft tokens this far from the context's end are kept, not re-encoded
JOIN = 1     # committed target tokens re-encoded with the drafted text


class VocabularyError(ValueError):
    """The draft's tokenizer cannot carry the target's text."""


@dataclass
class _Context:
    """One sequence as both tokenizers see it."""

    target: list[int] = field(default_factory=list)  # committed (and last proposed) ids
    target_ends: list[int] = field(default_factory=list)  # byte offset after each
    text: bytearray = field(default_factory=bytearray)    # their bytes
    draft: list[int] = field(default_factory=list)        # the draft's ids of the text
    # (target tokens, draft tokens) covering the same bytes, in order: re-encoding
    # starts at the last one inside the committed tokens
    anchors: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    kept: int = 0  # draft tokens the last re-encoding left as they were

    def truncate(self, num_target: int) -> None:
        del self.target[num_target:], self.target_ends[num_target:]
        del self.text[self.target_ends[-1] if self.target_ends else 0:]
        while self.anchors[-1][0] > num_target:
            self.anchors.pop()


class TextBridge:
    """Bytes between two tokenizers."""

    def __init__(self, target: Tokenizer, draft: Tokenizer, target_vocab: int,
                 draft_vocab: int) -> None:
        """*_vocab: the models' (ids past a tokenizer's, embedding padding, are no text)."""
        self.target, self.draft = target, draft
        self._target_bytes = [target.token_bytes(i) for i in range(target_vocab)]
        self._draft_bytes = [draft.token_bytes(i) for i in range(draft_vocab)]
        self.draft_special = draft.special_tokens  # id -> text
        self._target_byte_ids = _single_bytes(self._target_bytes)
        self._draft_byte_ids = _single_bytes(self._draft_bytes)
        self.check()
        # each draft token's one target token of the same bytes (special ones by their
        # text), -1: none [draft vocab]
        target_of = {raw: i for i, raw in reversed(list(enumerate(self._target_bytes))) if raw}
        target_of.update((text.encode(), i) for i, text in target.special_tokens.items())
        self.shared = torch.tensor([
            target_of.get(self.draft_special[d].encode() if d in self.draft_special else raw, -1)
            for d, raw in enumerate(self._draft_bytes)], dtype=torch.long)

    def check(self) -> None:
        """Every target token's text, encoded by the draft's tokenizer, decodes to itself
        (tokens that are part of a UTF-8 character are checked joined, as text)."""
        bad = []
        for i, raw in enumerate(self._target_bytes):
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                continue
            back = b"".join(self._draft_bytes[d] for d in self.draft.encode(text, False))
            if back != raw:
                bad.append(f"{i} {raw!r} -> {back!r}")
        if bad:
            raise VocabularyError(
                f"the draft's tokenizer cannot carry the target's text: {len(bad)} target "
                f"tokens do not round-trip through it (e.g. {', '.join(bad[:3])}); a draft "
                f"with a byte-level tokenizer can")

    def extend(self, ctx: _Context, token_ids: list[int]) -> None:
        for t in token_ids:
            ctx.text += self._target_bytes[t]
            ctx.target.append(t)
            ctx.target_ends.append(len(ctx.text))

    def redraft_context(self, ctx: _Context) -> None:
        """ctx.draft for ctx.text: kept up to the last anchor, the rest encoded anew;
        anchors then added where both tokenizations cut the new part at one byte, up to
        SETTLED draft tokens before its end."""
        num_target, num_draft = ctx.anchors[-1]
        ctx.kept = num_draft
        start = ctx.target_ends[num_target - 1] if num_target else 0
        tail = _whole_characters(bytes(ctx.text[start:]))
        new = _encode(self.draft, self._draft_byte_ids, tail)
        ctx.draft[num_draft:] = new
        ends = {e: k for k, e in enumerate(ctx.target_ends[num_target:], num_target + 1)}
        offset = start
        for j, d in enumerate(new[:max(0, len(new) - SETTLED)], num_draft + 1):
            offset += len(self._draft_bytes[d])
            if offset in ends:
                ctx.anchors.append((ends[offset], j))

    def to_target(self, ctx: _Context, drafted: list[int], gamma: int) -> list[int]:
        """The target's tokens for the drafted text after ctx.target, at most gamma."""
        text, end = bytearray(), None
        for d in drafted:
            if d in self.draft_special:  # its end of text: the target's, where it has one
                end = [int(self.shared[d])] if self.shared[d] >= 0 else []
                break
            text += self._draft_bytes[d]
        joined = ctx.target[-JOIN:]
        head = b"".join(self._target_bytes[t] for t in joined)
        ids = self._encode_target(head + text)
        # (where the target's tokenizer merges across the committed boundary: text alone)
        ids = ids[len(joined):] if ids[:len(joined)] == joined else self._encode_target(text)
        return (ids + end if end is not None else ids[:-1])[:gamma]

    def _encode_target(self, raw: bytes) -> list[int]:
        return _encode(self.target, self._target_byte_ids, _whole_characters(raw))


class CrossVocabDrafter:
    """A draft model of another vocabulary as a Proposer of the target's tokens."""

    def __init__(self, inner: Drafter, bridge: TextBridge, target_vocab: int) -> None:
        self.inner, self.bridge = inner, bridge
        self._vocab_size = target_vocab
        self._contexts: dict[object, _Context] = {}
        self._ends = tuple(sorted(bridge.draft_special))
        self._shared = bridge.shared.to(inner.runner.device)  # [draft vocab]
        self._shared_mask = self._shared >= 0  # what a sampled row may draft [draft vocab]

    # -- Proposer --------------------------------------------------------------------------
    vocab_size = property(lambda self: self._vocab_size)
    max_model_len = property(lambda self: self.inner.max_model_len)
    model_name = property(lambda self: self.inner.model_name)
    version = property(lambda self: self.inner.version)
    target_topk = property(lambda self: 0)
    drafts_trees = property(lambda self: False)
    prepares_ahead = property(lambda self: False)
    method = property(lambda self: CROSS_VOCAB_METHOD)  # counted apart from same-vocab drafts

    @property
    def reads_target(self) -> FeatureTap | None:
        return None

    def takes_guesses(self, kind: str) -> bool:
        return False

    def version_of(self, seq_id) -> int:
        return self.inner.version_of(seq_id)

    def release(self, seq_id) -> bool:
        self._contexts.pop(seq_id, None)
        return self.inner.release(seq_id)

    # -- what a draft replica's service asks of its drafter (draft_worker/service.py) ------
    runner = property(lambda self: self.inner.runner)
    num_evicted = property(lambda self: self.inner.num_evicted)
    num_misses = property(lambda self: self.inner.num_misses)

    def holds(self, item: DraftItem) -> bool:
        ctx = self._contexts.get(item.seq_id)
        return bool(item.new_token_ids) and (
            item.committed_len == 0 or (ctx is not None and item.committed_len <= len(ctx.target)))

    def evict_idle(self, max_idle_s: float) -> int:
        evicted = self.inner.evict_idle(max_idle_s)
        for seq_id in [s for s in self._contexts if s not in self.inner.token_ids]:
            del self._contexts[seq_id]
        return evicted

    def submit(self, items: list[DraftItem], device: torch.device,
               beside_target: bool = False) -> PendingProposal:
        out = self.draft(items, device)
        return PendingProposal(lambda: out)

    def draft(self, items: list[DraftItem], device: torch.device) -> Proposal:
        """Each item's γ as the target's tokens, drafted through text."""
        is_miss = [it.is_active and not self._sync(it) for it in items]
        inner = [self._inner_item(it) if it.is_active and not miss else None
                 for it, miss in zip(items, is_miss)]
        asked = [x for x in inner if x is not None]
        drafted = self.inner.draft(asked, device) if asked else None
        rows, k = [], 0
        for i, (it, x) in enumerate(zip(items, inner)):
            row: tuple[list[int], torch.Tensor | None] = ([], None)
            if x is not None:
                is_miss[i] = drafted.is_miss[k]
                if drafted.gammas[k]:
                    row = self._propose(it, drafted, k)
                k += 1
            rows.append(row)
        proposal = Proposal.of_rows(rows, self._vocab_size, device)
        proposal.is_miss = is_miss
        return proposal

    # -- the two vocabularies ----------------------------------------------------------------
    def _sync(self, item: DraftItem) -> bool:
        """The sequence's context at the caller's committed prefix; False: a MISS."""
        ctx = self._contexts.get(item.seq_id)
        if item.committed_len == 0:
            ctx = self._contexts[item.seq_id] = _Context()
        elif ctx is None or item.committed_len > len(ctx.target):
            return False
        ctx.truncate(item.committed_len)
        self.bridge.extend(ctx, item.new_token_ids)
        self.bridge.redraft_context(ctx)
        return True

    def _inner_item(self, item: DraftItem) -> DraftItem:
        """What the draft model is asked: its context as the draft's tokens, from the
        longest prefix it holds, and enough drafts to cover γ of the target's."""
        ctx = self._contexts[item.seq_id]
        held = self.inner.token_ids.get(item.seq_id, [])
        # the draft holds what it was sent (and its drafts): ctx.draft up to what the
        # re-encoding kept, so only the tail is compared; a context goes with a token
        limit = min(len(held), len(ctx.draft) - 1)
        common = min(ctx.kept, limit)
        while common < limit and held[common] == ctx.draft[common]:
            common += 1
        blocks = self.inner.runner.blocks
        if not (blocks.has(item.seq_id) and blocks.sealed_len(item.seq_id) <= common):
            common = 0  # sent whole: its sealed blocks come back from the prefix cache
        gamma = item.gamma
        if item.params.is_greedy and gamma:  # text: enough to cover γ of the target's
            per_token = len(ctx.draft) / max(1, len(ctx.target))
            gamma = min(3 * gamma, int(gamma * per_token + 0.999) + 2)
        return DraftItem(item.seq_id, common, ctx.draft[common:], gamma,
                         self._draft_params(item.params), item.seed, item.q_format,
                         prefill_only=item.prefill_only, allowed=self._shared_mask)

    def _draft_params(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling as the draft can do it: its temperature and truncation
        (token ids, penalties and grammars are the target's; its ends are the draft's)."""
        if params.is_greedy:
            return SamplingParams(max_tokens=1 << 20, eos_token_ids=self._ends)
        return SamplingParams(max_tokens=1 << 20, temperature=params.temperature,
                              top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                              eos_token_ids=self._ends)

    def _propose(self, item: DraftItem, drafted: Proposal, k: int
                 ) -> tuple[list[int], torch.Tensor | None]:
        """Row k's drafts as the target's tokens, and their q [n, target vocab] (None:
        point masses); they join the context as proposed (the caller counts those it
        keeps in its next committed_len). Greedy rows through text; sampled ones drew
        only tokens the target has too, each one target token with its q moved over."""
        ctx = self._contexts[item.seq_id]
        own = drafted.token_ids[k, :drafted.gammas[k]]  # [n] the draft's ids
        if item.params.is_greedy:
            ids, q = self.bridge.to_target(ctx, own.tolist(), item.gamma), None
        else:
            n = min(item.gamma, len(own))
            ids = self._shared[own[:n]].tolist()
            q_own = drafted.probs[k, :n]  # [n, draft vocab]
            q = q_own.new_zeros(n, self._vocab_size)  # [n, target vocab]
            q[:, self._shared[self._shared_mask]] = q_own[:, self._shared_mask]
        self.bridge.extend(ctx, ids)
        return ids, q


def across_vocabularies(drafter: Drafter, target_dir: str, draft_dir: str, target_vocab: int):
    """The drafter, or, when its vocabulary is not the target's, the drafter proposing
    the target's tokens through text (a Proposer either way)."""
    bridge = pair_bridge(target_dir, draft_dir)
    return drafter if bridge is None else CrossVocabDrafter(drafter, bridge, target_vocab)


def pair_bridge(target_dir: str, draft_dir: str) -> TextBridge | None:
    """None when draft and target share one vocabulary (same ids for the same tokens);
    otherwise the text bridge a draft of its own tokenizer proposes through (§2.9). A
    draft of another vocabulary size without a tokenizer.json cannot propose."""
    target_size, draft_size = (ModelConfig.from_dir(d).vocab_size for d in (target_dir, draft_dir))
    if shares_vocabulary(target_dir, draft_dir):
        return None
    try:
        draft_tok = Tokenizer(draft_dir)
    except TokenizerError:
        raise RequestError(f"draft and target have different vocabularies: "
                           f"{draft_size} vs {target_size} tokens, and the draft has no "
                           f"tokenizer.json to propose through text") from None
    try:
        return TextBridge(Tokenizer(target_dir), draft_tok, target_size, draft_size)
    except VocabularyError as exc:
        raise RequestError(str(exc)) from None


def _whole_characters(raw: bytes) -> bytes:
    """raw without a last UTF-8 character that more bytes could still complete."""
    return raw[:codecs.utf_8_decode(raw, "surrogateescape", False)[1]]


def _encode(tok: Tokenizer, single_bytes: dict[int, int], raw: bytes) -> list[int]:
    """tok's ids spelling raw: its text encoded, each byte that is not UTF-8 as the
    token of that one byte (a byte-level tokenizer has one for each)."""
    text = raw.decode(errors="surrogateescape")  # a stray byte: a lone surrogate
    ids = []
    for run in _SURROGATES.split(text):
        if run and "\udc80" <= run[0] <= "\udcff":
            ids += [single_bytes[ord(c) - 0xDC00] for c in run if ord(c) - 0xDC00 in single_bytes]
        elif run:
            ids += tok.encode(run, add_special_tokens=False)
    return ids


def _single_bytes(token_bytes: list[bytes]) -> dict[int, int]:
    """byte value -> the id of the token of that one byte."""
    return {raw[0]: i for i, raw in reversed(list(enumerate(token_bytes))) if len(raw) == 1}
