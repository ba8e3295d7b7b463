"""The proposer a target replica's loop talks to: the model-free lookups (lookup.py) and
the draft model, chosen per request and per round (docs/DESIGN.md §2.8).

It keeps every sequence's tokens (the lookups search them) and how much of them the
draft model holds, so it can call the model only in the rounds that use it: the model is
then sent what it missed since. A request names its kind (DraftItem.proposer, or the
replica's default); for AUTO, each round looks up first and then takes, of
  the lookup alone (no draft time, no round trip),
  the lookup continued by the model (the model drafts past the looked-up tokens),
  the model alone,
the one with the most expected tokens per second: expected tokens from the request's
acceptance of each kind (learnt from what the loop committed after each proposal),
seconds from the replica's cost model (verify time of the batch + the model's draft
time). Looked-up tokens are point masses (q one-hot), so verification stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from outrider.core.policy import CostModel
from outrider.core.sequence import ProposerKind, TeacherRow
from outrider.engine.lookup import SuffixCorpus, prompt_lookup, suffix_lookup
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal, Proposer, dense_q

EMPTY_CORPUS = SuffixCorpus(max_tokens=0)  # holds nothing: a lookup in the context alone
EXPLORE_EVERY = 4  # an AUTO request's rounds with a lookup: every 4th tries the model alone
ALPHA_WEIGHT = 0.2          # EWMA weight of a tested position, in a request's estimate
REPLICA_ALPHA_WEIGHT = 0.02  # ... in the replica's, where new requests start from


@dataclass
class _Acceptance:
    """P(a proposal is kept | the ones before it were), per proposer: an EWMA."""

    free: float = 0.7   # the lookups'
    model: float = 0.7  # the draft model's (the γ policy's own start)

    def observe(self, is_free: bool, hit: float, weight: float) -> None:
        if is_free:
            self.free += weight * (hit - self.free)
        else:
            self.model += weight * (hit - self.model)


@dataclass
class _Held:
    """What the mix holds of one sequence."""

    tokens: list[int] = field(default_factory=list)  # context + the last proposal
    num_context: int = 0   # tokens[num_context:] are the last proposal's drafts
    num_free: int = 0      # ... of which the first num_free were looked up
    shadow: list[int] = field(default_factory=list)  # a lookup not proposed (AUTO chose
    # the model alone): what followed tells how it would have done, at no cost
    model_len: int = 0     # the prefix of tokens the draft model holds
    has_model: bool = False  # the model was ever sent this sequence
    traceparent: str = ""
    teacher: list[TeacherRow] = field(default_factory=list)  # for the model's next call
    acceptance: _Acceptance = field(default_factory=_Acceptance)
    num_weighed: int = 0   # AUTO rounds that had a lookup and the model to choose from

    def take(self, item: DraftItem, replica: _Acceptance | None) -> None:
        """The loop's view: tokens[:committed_len] + the item's new tokens; first learn
        how many of the last proposal's drafts the loop kept, into this request's and the
        `replica`'s estimates (None: the new tokens are not all committed — drafting
        ahead sends this round's drafts as if accepted)."""
        context = self.tokens[:item.committed_len] + item.new_token_ids
        if replica is not None:
            self._learn(context, replica)
        self.tokens, self.num_context = context, len(context)
        self.model_len = min(self.model_len, item.committed_len, len(context) - 1)
        self.traceparent = self.traceparent or item.traceparent

    def _learn(self, context: list[int], replica: _Acceptance) -> None:
        seen = context[self.num_context:]
        tested = [(j < self.num_free, hit)
                  for j, hit in _tested(self.tokens[self.num_context:], seen)]
        tested += [(True, hit) for _, hit in _tested(self.shadow, seen)]
        for is_free, hit in tested:
            self.acceptance.observe(is_free, hit, ALPHA_WEIGHT)
            replica.observe(is_free, hit, REPLICA_ALPHA_WEIGHT)
        self.shadow = []


@dataclass
class _Plan:
    """One item's round: looked-up tokens, then `model_gamma` from the model."""

    item: DraftItem
    held: _Held | None  # None: an item with nothing to do this round
    free_kind: str = ""
    free: list[int] = field(default_factory=list)
    model_max: int = 0    # the most the model may draft (γ, its context permitting)
    model_gamma: int = 0
    model_item: DraftItem | None = None


class ProposerMix:
    """Proposer over the lookups and an optional draft model (Proposer protocol)."""

    def __init__(self, model: Proposer | None, vocab_size: int,
                 default: ProposerKind = ProposerKind.AUTO,
                 corpus: SuffixCorpus | None = None) -> None:
        if model is not None and model.vocab_size != vocab_size:
            raise ValueError(f"draft and target have different vocabularies "
                             f"({model.vocab_size} vs {vocab_size} tokens)")
        self.model, self.default = model, default
        self.corpus = corpus if corpus is not None else SuffixCorpus()
        self._vocab_size = vocab_size
        self._held: dict[object, _Held] = {}
        self.acceptance = _Acceptance()  # the replica's: where new requests start from
        # the replica's cost model, once measured (None: the model's time is not weighed)
        self.cost: Callable[[], CostModel | None] = lambda: None

    # -- Proposer ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return 1 << 62  # lookups have no context limit; the model's is checked per round

    @property
    def model_name(self) -> str:
        return self.model.model_name if self.model is not None else self.default.value

    @property
    def version(self) -> int:
        return self.model.version if self.model is not None else 0

    @property
    def target_topk(self) -> int:
        return self.model.target_topk if self.model is not None else 0

    def version_of(self, seq_id) -> int:
        return self.model.version_of(seq_id) if self.model is not None else 0

    def draft(self, items: list[DraftItem], device: torch.device) -> Proposal:
        return self.submit(items, device).result()

    def submit(self, items: list[DraftItem], device: torch.device,
               beside_target: bool = False) -> PendingProposal:
        plans, is_miss = self._plan(items, learn=not beside_target)
        asked = [p for p in plans if p.model_item is not None]
        pending = (self.model.submit([p.model_item for p in asked], device, beside_target)
                   if asked else None)
        return PendingProposal(lambda: self._assemble(plans, is_miss, asked, pending, device))

    def release(self, seq_id) -> bool:
        held = self._held.pop(seq_id, None)
        if held is None:
            return False
        self.corpus.add(held.tokens[:held.num_context])
        if held.has_model:
            self.model.release(seq_id)
        return True

    # -- a round -----------------------------------------------------------------------------
    def kind_of(self, item: DraftItem) -> ProposerKind:
        """The item's kind as this round runs it. A seeded sample must depend on its
        request alone (§3.5), not on what else the replica served or on timing: sampled
        AUTO requests draft with the model when there is one (and look up in their own
        tokens only when there is not, `_look_up`)."""
        kind = ProposerKind(item.proposer) if item.proposer else self.default
        if kind is ProposerKind.AUTO and self.model is not None and not item.params.is_greedy:
            return ProposerKind.MODEL
        return kind

    def is_model_free(self, kind: ProposerKind | None) -> bool:
        """Whether requests of `kind` (None: the default) never wait for the model."""
        return self.model is None or (kind or self.default).is_model_free

    def _plan(self, items: list[DraftItem], learn: bool) -> tuple[list[_Plan], list[bool]]:
        plans, is_miss = [], []
        for item in items:
            if not item.is_active:  # nothing to draft or take in this round
                plans.append(_Plan(item, None))
                is_miss.append(False)
                continue
            held = self._held.get(item.seq_id)
            if held is None:
                held = self._held[item.seq_id] = _Held(acceptance=replace(self.acceptance))
            miss = item.committed_len > len(held.tokens)
            is_miss.append(miss)
            plan = _Plan(item, held)
            plans.append(plan)
            if miss:
                continue
            held.take(item, self.acceptance if learn else None)
            if self.model is not None and not self.kind_of(item).is_model_free:
                held.teacher += item.teacher
            if item.prefill_only:
                plan.model_item = self._warm_item(item, held)
            elif item.gamma:
                self._choose(plan)
        self._weigh(plans)
        return plans, is_miss

    def _choose(self, plan: _Plan) -> None:
        """The looked-up tokens a round starts with (AUTO, NGRAM, SUFFIX) and how many the
        model drafts after them (AUTO, MODEL)."""
        kind, gamma, held = self.kind_of(plan.item), plan.item.gamma, plan.held
        if kind is not ProposerKind.MODEL:
            lookup = ProposerKind.NGRAM if kind is ProposerKind.NGRAM else ProposerKind.SUFFIX
            plan.free = self._look_up(lookup, held.tokens, gamma, plan.item.params.is_greedy)
            plan.free_kind = lookup.value if plan.free else ""
        if kind is ProposerKind.MODEL or kind is ProposerKind.AUTO:
            room = self.model.max_model_len - len(held.tokens) if self.model else 0
            plan.model_max = max(0, min(gamma, room))
            plan.model_gamma = max(0, min(gamma - len(plan.free), room))

    def _look_up(self, kind: ProposerKind, tokens: list[int], gamma: int,
                 with_corpus: bool) -> list[int]:
        """The lookup's proposal; a sampled request's (with_corpus False) comes from its
        own tokens only, so its seed gives the same sample whatever else was served."""
        context = np.asarray(tokens, dtype=np.int64)
        if kind is ProposerKind.NGRAM:
            return prompt_lookup(context, gamma)
        return suffix_lookup(context, gamma, self.corpus if with_corpus else EMPTY_CORPUS)

    def _weigh(self, plans: list[_Plan]) -> None:
        """AUTO rounds with a lookup and a model that could draft: keep the option with
        the most expected tokens per second (lookup alone, lookup + model, model alone).
        The model's round trip and its positions up to the round's largest γ are paid
        once per round: a row whose lookup won while others still call the model is
        weighed again with only what it would add."""
        cost = self.cost()
        auto = [p for p in plans if p.model_max and p.free
                and self.kind_of(p.item) is ProposerKind.AUTO]
        if auto:
            batch = sum(1 + p.item.gamma for p in plans if p.item.gamma)
            verify_s = float(cost.verify_seconds(batch)) if cost else 1.0
            looked_up = {id(p): p.free for p in auto}
            choosing = {id(p) for p in auto}
            others = max((p.model_gamma for p in plans if id(p) not in choosing), default=0)
            for p in auto:
                p.held.num_weighed += 1
                p.free, p.model_gamma = _best_option(p, verify_s, _draft_cost(cost, others))
                if p.held.num_weighed % EXPLORE_EVERY == 0:
                    # the model's acceptance where a lookup exists is only learnt by trying
                    # it there: the rounds without a lookup are the hard ones
                    p.free, p.model_gamma = [], p.model_max
            largest = max(p.model_gamma for p in plans)
            for p in auto:
                if largest and not p.model_gamma and p.free:
                    p.free, p.model_gamma = _best_option(p, verify_s,
                                                         _draft_cost(cost, largest))
            for p in auto:
                p.free_kind = p.free_kind if p.free else ""
                p.held.shadow = [] if p.free else looked_up[id(p)]
        self._make_model_items(plans)

    def _make_model_items(self, plans: list[_Plan]) -> None:
        for p in plans:
            if p.model_gamma:
                held = p.held
                new = held.tokens[held.model_len:] + p.free
                p.model_item = replace(p.item, committed_len=held.model_len,
                                       new_token_ids=new, gamma=p.model_gamma,
                                       traceparent="" if held.has_model else held.traceparent,
                                       teacher=held.teacher)
                held.teacher = []

    def _warm_item(self, item: DraftItem, held: _Held) -> DraftItem | None:
        """A prefill for the model: AUTO and MODEL requests draft from it next round."""
        if self.model is None or self.kind_of(item).is_model_free:
            return None
        return replace(item, committed_len=held.model_len,
                       new_token_ids=held.tokens[held.model_len:],
                       traceparent="" if held.has_model else held.traceparent)

    def _assemble(self, plans: list[_Plan], is_miss: list[bool], asked: list[_Plan],
                  pending: PendingProposal | None, device: torch.device) -> Proposal:
        drafted = pending.result() if pending is not None else None
        if drafted is not None:
            drafted = self._retry_misses(asked, drafted, device)
        by_plan = {id(p): k for k, p in enumerate(asked)}
        rows, sources = [], []
        for p, miss in zip(plans, is_miss):
            k = by_plan.get(id(p))
            model_ids, model_q = [], None
            if k is not None:
                p.held.has_model = True
                model_ids, model_q = self._model_part(p, drafted, k)
            ids = p.free + model_ids
            q = None
            if model_q is not None:  # [n, vocab]: the looked-up part as point masses
                free_ids = torch.tensor(p.free, dtype=torch.long, device=model_q.device)
                q = torch.cat([dense_q(None, free_ids[None], self.vocab_size)[0], model_q])
            rows.append((ids, q))
            sources.append((p.free_kind, len(p.free)))
            if p.held is not None and not miss:
                p.held.tokens = p.held.tokens[:p.held.num_context] + ids
                p.held.num_free = len(p.free)
        out = Proposal.of_rows(rows, self.vocab_size, device, sources) if any(
            ids for ids, _ in rows) else Proposal.empty(len(plans), device)
        out.is_miss = is_miss
        return out

    def _model_part(self, p: _Plan, drafted: Proposal, k: int
                    ) -> tuple[list[int], torch.Tensor | None]:
        """The model's tokens for plan `p` (row k of `drafted`) and their q, and what the
        model now holds."""
        g, held = drafted.gammas[k], p.held
        context_len = p.model_item.committed_len + len(p.model_item.new_token_ids)
        if p.item.prefill_only:
            if not drafted.is_miss[k]:
                held.model_len = context_len
            return [], None
        if not g:
            return [], None
        held.model_len = context_len + g - 1
        ids = drafted.token_ids[k, :g].tolist()
        q = None if drafted.probs is None else drafted.probs[k, :g]
        return ids, q

    def _retry_misses(self, asked: list[_Plan], drafted: Proposal,
                      device: torch.device) -> Proposal:
        """The model lost some sequences: send each its whole context once."""
        missed = [k for k, miss in enumerate(drafted.is_miss)
                  if miss and not asked[k].item.prefill_only]
        if not missed:
            return drafted
        retries = []
        for k in missed:
            p = asked[k]  # its held tokens are still the context: the round is not assembled
            p.model_item = replace(p.model_item, committed_len=0,
                                   new_token_ids=p.held.tokens + p.free,
                                   traceparent=p.held.traceparent)
            retries.append(p.model_item)
        return drafted.with_rows(missed, self.model.draft(retries, device))


def _draft_cost(cost: CostModel | None, paid_up_to: int) -> Callable[[int], float]:
    """Seconds the model adds to a round by drafting n tokens for one more row, when the
    round already has the model draft up to γ `paid_up_to` (0: not called at all)."""
    def seconds(n: int) -> float:
        if not cost or not n:
            return 0.0
        if not paid_up_to:
            return float(cost.draft_seconds(n, n))
        return (cost.draft_per_token_s * n
                + cost.draft_per_position_s * max(0, n - paid_up_to))
    return seconds


def _best_option(p: _Plan, verify_s: float, draft_s: Callable[[int], float]
                 ) -> tuple[list[int], int]:
    """(looked-up tokens, model γ) of the option with the most expected tokens per second.
    `p.free` is the lookup's whole proposal (the first pass may have cut it)."""
    free, held = p.free, p.held
    k = len(free)
    chained = max(0, p.model_max - k)
    alpha = held.acceptance
    free_tokens = _expected(alpha.free, k)
    chain_tokens = free_tokens + alpha.free ** k * _expected(alpha.model, chained)
    options = [((1 + free_tokens) / verify_s, (free, 0)),
               ((1 + chain_tokens) / (verify_s + draft_s(chained)),
                (free, chained)),  # the same as the lookup alone when it fills γ
               ((1 + _expected(alpha.model, p.model_max)) /
                (verify_s + draft_s(p.model_max)), ([], p.model_max))]
    return max(options, key=lambda o: o[0])[1]


def _tested(proposed: list[int], committed: list[int]) -> list[tuple[int, float]]:
    """(position, 1.0 kept / 0.0 rejected) of each proposal verification tested: the kept
    prefix and the first one that differs (what followed it was never tested)."""
    kept = next((j for j, (a, b) in enumerate(zip(proposed, committed)) if a != b),
                min(len(proposed), len(committed)))
    return [(j, 1.0 if j < kept else 0.0)
            for j in range(min(kept + 1, len(proposed), len(committed)))]


def _expected(alpha: float, n: int) -> float:
    """Expected accepted tokens of n proposals, each kept with probability alpha given
    the ones before it were."""
    return sum(alpha ** j for j in range(1, n + 1))
