"""The proposer contract: what the speculative loop asks of whatever proposes draft tokens.

The local draft model (`drafter.Drafter`), the remote draft replicas
(`target_worker/remote_drafter.RemoteDrafter`) and any future proposer implement
`Proposer`. The contract mirrors the wire protocol's Propose
(protos/outrider/v1/worker.proto): the caller says which prefix it believes the proposer
holds (`committed_len`) and sends the committed tokens after it; a proposer that no longer
holds that prefix answers MISS and the caller resends the whole context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from outrider.core.sampling import SamplingParams
from outrider.core.sequence import TeacherRow
from outrider.engine.features import FeatureTap
from outrider.engine.rejection import dense_draft_probs
from outrider.engine.tree import TreeShape, chain


@dataclass
class DraftItem:
    """What to propose for one sequence."""

    seq_id: object
    committed_len: int          # prefix the caller believes the proposer holds
    new_token_ids: list[int]    # committed tokens from committed_len on
    gamma: int
    params: SamplingParams
    seed: int
    q_format: str = "dense"
    traceparent: str = ""       # the request's trace context, when the sequence starts
    prefill_only: bool = False  # take the new tokens into the cache, draft nothing (gamma 0)
    prompt_len: int = 0         # the sequence's prompt: penalties count output after it
    # the target's top-k at committed positions (an adapting draft learns from them)
    teacher: list[TeacherRow] = field(default_factory=list)
    proposer: str = ""          # the request's ProposerKind ("": the replica's default)
    # tokens the request's grammar forces after new_token_ids: free drafts (§3.8)
    forced: list[int] = field(default_factory=list)
    # a head's (reads_target): the target's feature before each new token,
    # [len(new_token_ids), width] (engine/features.py)
    features: torch.Tensor | None = None
    # draft a token tree γ deep (engine/tree.py); None or top-k 1: a chain. A proposer
    # that cannot draft trees proposes a chain
    tree: TreeShape | None = None
    # answer only from what the proposer prepared while the target verified (a draft
    # replica's speculation cache, docs/DESIGN.md §2.6): otherwise no drafts this round,
    # and the new tokens are not taken in (the next round sends them again)
    ready_only: bool = False
    # a speculation cache drafts its next round's stand-ins (CacheMissChoice.prepares)
    prepare: bool = True
    # the target's argmax at the last round's verification rows past the committed tokens
    # (Proposer.takes_guesses: lookahead's Jacobi guesses for the positions that follow)
    guesses: list[int] = field(default_factory=list)
    # the tokens a sampled row may draft [vocab] bool (None: all): a draft of another
    # vocabulary samples only those the target has too (cross_vocab.py)
    allowed: torch.Tensor | None = None
    # sent beside verification to a speculation cache: answered once the likely outcomes
    # of this round are drafted, with them (Proposal.prepared); gamma 0: collect those its
    # last Propose had prepared (docs/DESIGN.md §2.6, delivery)
    deliver: bool = False

    @property
    def is_active(self) -> bool:
        """Whether the proposer has work for this item: drafting, a prefill, or a
        delivery of what it prepared."""
        return bool(self.gamma or (self.prefill_only and self.new_token_ids) or self.deliver)

    @property
    def collects(self) -> bool:
        """It asks only for the outcomes its sequence's last Propose had prepared."""
        return self.deliver and not self.gamma


@dataclass
class Proposal:
    """The draft tokens proposed for a batch of items, and the q they were drawn from."""

    token_ids: torch.Tensor  # [batch, max_gamma] int64 (0 in padding)
    # [batch, max_gamma, vocab] q after the request's processing; None when every row is
    # a point mass at its token (greedy drafting): nothing dense is built or sent
    probs: torch.Tensor | None
    gammas: list[int]        # tokens proposed per item (0 on a miss or when the KV is full)
    is_miss: list[bool]      # prefill-only items: True unless the proposer now caches them
    # per item, its first num_free proposals were looked up (free_kinds: "ngram",
    # "suffix"), the rest drafted by the model; empty: every proposal is the model's
    num_free: list[int] = field(default_factory=list)
    free_kinds: list[str] = field(default_factory=list)
    # per item, the parent of each proposal (engine/tree.py; every q a point mass); None:
    # every item's proposals are a chain
    parents: list[list[int]] | None = None
    # per item, the rank of the speculation-cache outcome its drafts were prepared for
    # (1: the likeliest), 0: drafted for this call; empty: none came from a cache
    cache_ranks: list[int] = field(default_factory=list)
    # per item (DraftItem.deliver), the outcomes of the round under verification a
    # speculation cache drafted: the tokens the target commits -> (the next round's
    # drafts, the outcome's rank); empty: none delivered
    prepared: list[dict[tuple[int, ...], tuple[list[int], int]]] = field(default_factory=list)

    def parents_of(self, k: int) -> list[int]:
        """Item k's tree (a chain's parents for a chain)."""
        return chain(self.gammas[k]) if self.parents is None else self.parents[k]

    def cache_rank(self, k: int) -> int:
        return self.cache_ranks[k] if self.cache_ranks else 0

    def prepared_for(self, k: int) -> dict[tuple[int, ...], tuple[list[int], int]]:
        return self.prepared[k] if self.prepared else {}

    def source(self, k: int) -> tuple[str, int]:
        """(the model-free kind, how many of item k's proposals it gave: they come first)."""
        n = self.num_free[k] if self.num_free else 0
        return (self.free_kinds[k], n) if n else ("", 0)

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> Proposal:
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device), None,
                   [0] * batch, [False] * batch)

    @classmethod
    def of_rows(cls, rows: list[tuple[list[int], torch.Tensor | None]], vocab: int,
                device: torch.device, sources: list[tuple[str, int]] = (),
                parents: list[list[int]] | None = None) -> Proposal:
        """Rows of (token ids [n_k], their q [n_k, vocab] or None for point masses), where
        they came from (`source`; none: the model) and their trees (None: chains)."""
        width = max((len(ids) for ids, _ in rows), default=0)
        token_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for k, (ids, _) in enumerate(rows):
            token_ids[k, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        probs = None
        if any(q is not None for _, q in rows):
            probs = dense_draft_probs(token_ids, vocab)
            for k, (ids, q) in enumerate(rows):
                if q is not None:
                    probs[k, :len(ids)] = q
        return cls(token_ids, probs, [len(ids) for ids, _ in rows], [False] * len(rows),
                   [n for _, n in sources], [kind for kind, _ in sources], parents)

    def dense_probs(self, vocab: int) -> torch.Tensor:
        """q rows [batch, max_gamma, vocab], point masses made dense."""
        return dense_q(self.probs, self.token_ids, vocab)

    def with_rows(self, rows: list[int], other: Proposal) -> Proposal:
        """`other`'s proposals (one per entry of `rows`) in place of those rows, widening
        γ if needed."""
        width = max(self.token_ids.shape[1], other.token_ids.shape[1])
        extra = width - self.token_ids.shape[1]
        token_ids = torch.nn.functional.pad(self.token_ids, (0, extra))
        probs = other_probs = None
        if self.probs is not None or other.probs is not None:
            vocab = (self.probs if self.probs is not None else other.probs).shape[-1]
            probs = torch.nn.functional.pad(self.dense_probs(vocab), (0, 0, 0, extra))
            other_probs = other.dense_probs(vocab)
        gammas = list(self.gammas)
        sources = [self.source(i) for i in range(len(gammas))]
        parents = None
        if self.parents is not None or other.parents is not None:
            parents = [self.parents_of(i) for i in range(len(gammas))]
        ranks = [self.cache_rank(i) for i in range(len(gammas))]
        prepared = [self.prepared_for(i) for i in range(len(gammas))]
        for k, i in enumerate(rows):
            g = other.gammas[k]
            token_ids[i, :g], gammas[i] = other.token_ids[k, :g], g
            sources[i], ranks[i] = other.source(k), other.cache_rank(k)
            prepared[i] = other.prepared_for(k)
            if probs is not None:
                probs[i, :g] = other_probs[k, :g]
            if parents is not None:
                parents[i] = other.parents_of(k)
        return Proposal(token_ids, probs, gammas, [False] * len(gammas),
                        [n for _, n in sources], [kind for kind, _ in sources], parents,
                        ranks if any(ranks) else [], prepared if any(prepared) else [])


def dense_q(probs: torch.Tensor | None, token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """q rows [batch, γ, vocab]: `probs`, or the point masses at `token_ids` [batch, γ]."""
    return probs if probs is not None else dense_draft_probs(token_ids, vocab)


class PendingProposal:
    """A proposal in flight: `result()` waits for it (once) and returns it."""

    def __init__(self, wait: Callable[[], Proposal]) -> None:
        self._wait, self._out = wait, None

    def result(self) -> Proposal:
        if self._out is None:
            self._out = self._wait()
        return self._out


class Proposer(Protocol):
    """What proposes draft tokens for the target to verify (docs/DESIGN.md §2.5-2.6)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int:
        """Longest context it can propose after (past it, γ is 0)."""

    @property
    def model_name(self) -> str: ...

    @property
    def version(self) -> int:
        """The newest weights' version proposing (0: as loaded, or no weights)."""

    @property
    def target_topk(self) -> int:
        """k of the target's top-k rows it wants with each sequence (0: none)."""

    def takes_guesses(self, kind: str) -> bool:
        """Whether it wants, for requests of `kind` (a ProposerKind's value, "": its
        default), the target's argmax at the verification rows past each round's
        committed tokens with the sequence's next item (DraftItem.guesses)."""

    @property
    def reads_target(self) -> FeatureTap | None:
        """The target's hidden states it drafts from (a head: DraftItem.features), None
        for a proposer of tokens alone. A head's drafts are re-made from the target's
        features once verified: it holds no more than the committed tokens."""

    @property
    def drafts_trees(self) -> bool:
        """Whether it drafts a token tree for an item that asks (DraftItem.tree); one
        that does not proposes chains."""

    @property
    def prepares_ahead(self) -> bool:
        """Whether it drafts the likely next rounds while the target verifies (a draft
        replica's speculation cache): an item may then ask for what is ready only
        (DraftItem.ready_only)."""

    @property
    def method(self) -> str:
        """What its weights are, by vLLM's names for speculative methods: "draft_model",
        or a head's "eagle3", "eagle" or "medusa" (metrics and statistics count its
        proposals under it; model-free lookups count under their own)."""

    def draft(self, items: list[DraftItem], device: torch.device) -> Proposal:
        """Propose now, and wait for the proposal."""

    def submit(self, items: list[DraftItem], device: torch.device,
               beside_target: bool = False) -> PendingProposal:
        """Start proposing; `beside_target`: the target verifies meanwhile."""

    def release(self, seq_id) -> bool:
        """Forget a sequence; False when it held nothing for it."""

    def version_of(self, seq_id) -> int:
        """The weights' version that proposes for `seq_id`."""
