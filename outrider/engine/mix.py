"""The proposer a target replica's loop talks to: the model-free lookups (lookup.py) and
the draft model, chosen per request and per round (docs/DESIGN.md §2.8).

It keeps every sequence's tokens (the lookups search them) and how much of them the
draft model holds, so it can call the model only in the rounds that use it: the model is
then sent what it missed since. A request names its kind (DraftItem.proposer, or the
replica's default); for AUTO, each round looks up first and then takes, of
  the lookup alone (no draft time, no round trip),
  the lookup continued by the model (the model drafts past the looked-up tokens),
  the model alone,
by which is likelier to be kept: the request's acceptance of the lookup at the length
of suffix it matched against its acceptance of the model, both learnt from what the loop
committed after each proposal (`_choice`). Tokens a constrained request's grammar forces
(DraftItem.forced: a schema's next key, say) lead the round whatever its kind, and the
model continues after them. Looked-up and forced tokens are point masses (q one-hot), so
verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from outrider.core.grammar import Grammars
from outrider.core.sampling import SamplingParams
from outrider.core.sequence import NGRAM_SIZES, ProposerKind, TeacherRow
from outrider.core.stats import GRAMMAR_METHOD, MODEL_METHOD
from outrider.engine.features import FeatureLog
from outrider.engine.lookahead import Lookahead
from outrider.engine.lookup import Lookup, SuffixCorpus, prompt_lookup, suffix_lookup
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal, Proposer, dense_q
from outrider.engine.tree import chain, first_path

EXPLORE_EVERY = 4  # an AUTO request's rounds with a lookup: every 4th tries the model alone
ALPHA_WEIGHT = 0.2          # EWMA weight of a tested position, in a request's estimate
REPLICA_ALPHA_WEIGHT = 0.02  # ... in the replica's, where new requests start from


LOOKUP_KEY = "lookup"  # with a sequence's id, the grammars' key of its lookups' matcher
#                       (its context holds drafts sent as accepted: not the loop's output)
MATCH_BUCKETS = 8  # lookups' acceptance is kept by match length: 1, 2, ..., 8 or more


@dataclass
class _Acceptance:
    """P(a proposal is kept | the ones before it were), per proposer: an EWMA; the
    lookups' by the length of the context suffix they matched (the evidence they had)."""

    # the lookups', by match length; a start that trusts longer matches more
    free: list[float] = field(default_factory=lambda: [0.3, 0.4, 0.5, 0.55, 0.6, 0.65,
                                                       0.7, 0.75])
    model: float = 0.7  # the draft model's (the γ policy's own start)

    def of_lookup(self, match_len: int) -> float:
        return self.free[min(max(match_len, 1), MATCH_BUCKETS) - 1]

    def observe(self, match_len: int, hit: float, weight: float) -> None:
        """A tested position: looked up after a `match_len` match, or (0) the model's."""
        if match_len:
            k = min(match_len, MATCH_BUCKETS) - 1
            self.free[k] += weight * (hit - self.free[k])
        else:
            self.model += weight * (hit - self.model)

    def copy(self) -> _Acceptance:
        return _Acceptance(list(self.free), self.model)


@dataclass
class _Held:
    """What the mix holds of one sequence."""

    tokens: list[int] = field(default_factory=list)  # context + the last proposal
    num_context: int = 0   # tokens[num_context:] are the last proposal's drafts
    num_free: int = 0      # ... of which the first num_free were looked up or forced
    free_match: int = 0    # ... after a match of this many tokens
    free_forced: bool = False  # ... forced by the grammar: no choice, nothing to learn
    shadow_match: int = 0  # the match behind `shadow`:
    shadow: list[int] = field(default_factory=list)  # a lookup not proposed (AUTO chose
    # the model alone): what followed tells how it would have done, at no cost
    model_len: int = 0     # the prefix of tokens the draft model holds
    has_model: bool = False  # the model was ever sent this sequence
    traceparent: str = ""
    teacher: list[TeacherRow] = field(default_factory=list)  # for the model's next call
    acceptance: _Acceptance = field(default_factory=_Acceptance)
    num_weighed: int = 0   # AUTO rounds that had a lookup and the model to choose from
    lookahead: Lookahead = field(default_factory=Lookahead)  # LOOKAHEAD's guesses, pool

    def take(self, item: DraftItem, learn: bool, replica: _Acceptance | None) -> None:
        """The loop's view: tokens[:committed_len] + the item's new tokens; first learn
        how many of the last proposal's drafts the loop kept, into this request's and the
        `replica`'s estimates (None: only this request's). Not `learn`: the new tokens are
        not all committed — drafting ahead sends this round's drafts as if accepted."""
        drafts = self.tokens[self.num_context:]  # in place: no copy of the context a round
        del self.tokens[item.committed_len:]
        self.tokens.extend(item.new_token_ids)
        if learn:
            self._learn(drafts, self.tokens[self.num_context:], replica)
        self.num_context = len(self.tokens)
        self.model_len = min(self.model_len, item.committed_len, self.num_context - 1)
        self.traceparent = self.traceparent or item.traceparent

    def propose(self, ids: list[int], num_free: int, free_match: int,
                free_forced: bool) -> None:
        """The round's proposal after the context (the first num_free looked up, or
        forced by the grammar)."""
        del self.tokens[self.num_context:]
        self.tokens.extend(ids)
        self.num_free, self.free_match, self.free_forced = num_free, free_match, free_forced

    def _learn(self, drafts: list[int], seen: list[int], replica: _Acceptance | None) -> None:
        """`drafts`: the last proposal; `seen`: what the loop committed after them."""
        tested = [(self.free_match if j < self.num_free else 0, hit)
                  for j, hit in _tested(drafts, seen)
                  if j >= self.num_free or not self.free_forced]
        tested += [(self.shadow_match, hit) for _, hit in _tested(self.shadow, seen)]
        for match_len, hit in tested:
            self.acceptance.observe(match_len, hit, ALPHA_WEIGHT)
            if replica is not None:
                replica.observe(match_len, hit, REPLICA_ALPHA_WEIGHT)
        self.shadow = []


@dataclass
class _Plan:
    """One item's round: looked-up tokens, then `model_gamma` from the model."""

    item: DraftItem
    held: _Held | None  # None: an item with nothing to do this round
    kind: ProposerKind = ProposerKind.AUTO  # as this round runs it (ProposerMix.kind_of)
    free_kind: str = ""
    free: list[int] = field(default_factory=list)
    free_match: int = 0   # the suffix the lookup matched, in tokens
    model_max: int = 0    # the most the model may draft (γ, its context permitting)
    model_gamma: int = 0
    model_item: DraftItem | None = None

    @property
    def is_forced(self) -> bool:
        """Its free tokens are the grammar's: on top of γ, no choice to weigh or learn."""
        return self.free_kind == GRAMMAR_METHOD


class ProposerMix:
    """Proposer over the lookups and an optional draft model (Proposer protocol)."""

    def __init__(self, model: Proposer | None, vocab_size: int,
                 default: ProposerKind = ProposerKind.AUTO,
                 corpus: SuffixCorpus | None = None, grammars: Grammars | None = None,
                 ngram_sizes: tuple[int, int] = NGRAM_SIZES) -> None:
        if model is not None and model.vocab_size != vocab_size:
            raise ValueError(f"draft and target have different vocabularies "
                             f"({model.vocab_size} vs {vocab_size} tokens)")
        self.model, self.default = model, default
        self.corpus = corpus if corpus is not None else SuffixCorpus()
        self._vocab_size = vocab_size
        self._held: dict[object, _Held] = {}
        self.acceptance = _Acceptance()  # the replica's: where new requests start from
        # a head drafts only after tokens the target verified (it reads their features):
        # it cannot continue a lookup's or a grammar's tokens
        self.continues = model is None or model.reads_target is None
        self.features = FeatureLog()  # a head's, of tokens it has not been sent
        self.grammars = grammars  # the target's: constrained requests' lookups keep to them
        if not 1 <= ngram_sizes[0] <= ngram_sizes[1]:
            raise ValueError(f"n-gram sizes {ngram_sizes}: 1 <= MIN <= MAX")
        self.ngram_sizes = ngram_sizes  # the n-gram lookup's shortest and longest match

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

    @property
    def drafts_trees(self) -> bool:
        return self.model is not None and self.model.drafts_trees

    @property
    def reads_target(self):
        return self.model.reads_target if self.model is not None else None

    @property
    def method(self) -> str:
        return self.model.method if self.model is not None else MODEL_METHOD

    @property
    def prepares_ahead(self) -> bool:
        return self.model is not None and self.model.prepares_ahead

    def version_of(self, seq_id) -> int:
        return self.model.version_of(seq_id) if self.model is not None else 0

    def takes_guesses(self, kind: str) -> bool:
        return (ProposerKind(kind) if kind else self.default) is ProposerKind.LOOKAHEAD

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
        self.features.drop(seq_id)
        if self.grammars is not None:
            self.grammars.release((LOOKUP_KEY, seq_id))
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
        AUTO requests draft with the model when there is one (verified by rejection
        sampling, their tokens depend on what proposed them; a lookup's point masses
        emit the target's own sample, whatever the corpus held, §3.2)."""
        return self._runs_as(ProposerKind(item.proposer) if item.proposer else None,
                             item.params)

    def _runs_as(self, kind: ProposerKind | None, params: SamplingParams) -> ProposerKind:
        kind = kind or self.default
        if kind is ProposerKind.AUTO and self.model is not None and not params.is_greedy:
            return ProposerKind.MODEL
        return kind

    def stands_in_for_model(self, kind: ProposerKind | None, params: SamplingParams) -> bool:
        """Whether a lookup may take the model's place in rounds of requests of `kind`
        (None: the default): those that run as AUTO beside a model (`kind_of`)."""
        return self.model is not None and self._runs_as(kind, params) is ProposerKind.AUTO

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
            if item.collects:  # the model's prepared outcomes: nothing taken, nothing drafted
                plans.append(_Plan(item, None, model_item=item if self._has_model(item) else None))
                is_miss.append(False)
                continue
            held = self._held.get(item.seq_id)
            if held is None:
                held = self._held[item.seq_id] = _Held(acceptance=self.acceptance.copy())
            miss = item.committed_len > len(held.tokens)
            is_miss.append(miss)
            plan = _Plan(item, held, self.kind_of(item))
            plans.append(plan)
            if miss:
                continue
            # a constrained request's lookups are cut by its grammar: their outcomes
            # would teach other requests what only holds under it
            # (a delivery's new tokens are committed, as a Propose's)
            held.take(item, learn or item.deliver, None if item.params.structured_output
                      is not None else self.acceptance)
            if item.features is not None:  # row i: the feature before new token i
                self.features.add(item.seq_id, item.committed_len - 1, item.features)
            if self.model is not None and not plan.kind.is_model_free:
                held.teacher += item.teacher
            if item.prefill_only:
                plan.model_item = self._warm_item(plan)
            elif item.deliver:  # the model's drafts are being verified: it drafts on alone
                room = self.model.max_model_len - len(held.tokens) if self.model else 0
                plan.model_max = plan.model_gamma = max(0, min(item.gamma, room))
            elif item.gamma:
                self._choose(plan)
        self._weigh(plans)
        self._make_model_items(plans)
        return plans, is_miss

    def _choose(self, plan: _Plan) -> None:
        """The tokens a round starts with: forced by the grammar (any kind; on top of γ),
        else looked up (AUTO, NGRAM, SUFFIX, within γ); and how many the model drafts after
        them (AUTO, MODEL)."""
        kind, gamma, held = plan.kind, plan.item.gamma, plan.held
        if plan.item.forced:
            plan.free, plan.free_kind = list(plan.item.forced), GRAMMAR_METHOD
        elif kind is ProposerKind.LOOKAHEAD:
            plan.free, plan.free_match = held.lookahead.propose(
                held.tokens, plan.item.guesses, gamma, self.ngram_sizes)
            plan.free = self._within_grammar(plan.item, held.tokens, plan.free)
            plan.free_kind = kind.value if plan.free else ""
        elif kind is not ProposerKind.MODEL:
            lookup = ProposerKind.NGRAM if kind is ProposerKind.NGRAM else ProposerKind.SUFFIX
            plan.free, plan.free_match = self._look_up(lookup, held.tokens, gamma)
            plan.free = self._within_grammar(plan.item, held.tokens, plan.free)
            plan.free_kind = lookup.value if plan.free else ""
        if kind is ProposerKind.MODEL or kind is ProposerKind.AUTO:
            room = self.model.max_model_len - len(held.tokens) if self.model else 0
            looked_up = 0 if plan.is_forced else len(plan.free)
            plan.model_max = max(0, min(gamma, room))
            plan.model_gamma = max(0, min(gamma - looked_up, room - len(plan.free)))
            if plan.free and not self.continues:
                plan.model_gamma = 0

    def _look_up(self, kind: ProposerKind, tokens: list[int], gamma: int) -> Lookup:
        context = np.asarray(tokens, dtype=np.int64)
        if kind is ProposerKind.NGRAM:
            return prompt_lookup(context, gamma, *self.ngram_sizes)
        return suffix_lookup(context, gamma, self.corpus)

    def _within_grammar(self, item: DraftItem, context: list[int],
                        looked_up: list[int]) -> list[int]:
        """A constrained request's lookup up to the first token its grammar refuses: the
        lookups know no grammar, and a refused token would end the round there (the model
        drafts under the grammar, after what is kept)."""
        so = item.params.structured_output
        if so is None or not looked_up or self.grammars is None:
            return looked_up
        return looked_up[:self.grammars.allowed_len((LOOKUP_KEY, item.seq_id), so, context,
                                                    item.prompt_len, looked_up)]

    def _weigh(self, plans: list[_Plan]) -> None:
        """AUTO rounds with a lookup and a model that could draft (`_choice`)."""
        for p in plans:
            if p.model_max and p.free and p.kind is ProposerKind.AUTO and not p.is_forced:
                looked_up = p.free
                p.held.num_weighed += 1
                if p.held.num_weighed % EXPLORE_EVERY == 0:
                    # the model's acceptance where a lookup exists is only learnt by trying
                    # it there: the rounds without a lookup are the hard ones
                    p.free, p.model_gamma = [], p.model_max
                else:
                    p.free, p.model_gamma = _choice(p, self.continues)
                p.free_kind = p.free_kind if p.free else ""
                p.held.shadow, p.held.shadow_match = ([] if p.free else looked_up), p.free_match

    def _make_model_items(self, plans: list[_Plan]) -> None:
        for p in plans:
            if p.model_gamma:
                p.model_item = self._model_item(p, p.free, gamma=p.model_gamma,
                                                teacher=p.held.teacher)
                if p.model_item is None:
                    p.model_gamma = 0  # the head lost features it needs: no draft for it
                    continue
                p.held.teacher = []

    def _has_model(self, item: DraftItem) -> bool:
        """Whether the model was ever sent the sequence."""
        held = self._held.get(item.seq_id)
        return self.model is not None and held is not None and held.has_model

    def _warm_item(self, plan: _Plan) -> DraftItem | None:
        """A prefill for the model: AUTO and MODEL requests draft from it next round."""
        if self.model is None or plan.kind.is_model_free:
            return None
        return self._model_item(plan, [])

    def _model_item(self, plan: _Plan, free: list[int], **changes) -> DraftItem | None:
        """The item the model gets: the tokens it lacks (+ `free`), a head's with their
        features (None: some are gone)."""
        held = plan.held
        features = None if self.continues else self.features.rows_for(
            plan.item.seq_id, held.model_len, len(held.tokens) - held.model_len)
        if features is None and not self.continues:
            return None
        return replace(plan.item, committed_len=held.model_len,
                       new_token_ids=held.tokens[held.model_len:] + free,
                       traceparent="" if held.has_model else held.traceparent,
                       features=features, **changes)

    def _assemble(self, plans: list[_Plan], is_miss: list[bool], asked: list[_Plan],
                  pending: PendingProposal | None, device: torch.device) -> Proposal:
        drafted = pending.result() if pending is not None else None
        if drafted is not None:
            drafted = self._retry_misses(asked, drafted, device)
        by_plan = {id(p): k for k, p in enumerate(asked)}
        rows, sources, trees, ranks = [], [], [], []
        is_miss = list(is_miss)
        for i, p in enumerate(plans):
            k = by_plan.get(id(p))
            model_ids, model_q = [], None
            if p.item.collects:  # (its outcomes come below: Proposal.prepared)
                rows.append(([], None))
                sources.append(("", 0))
                trees.append([])
                ranks.append(0)
                continue
            if k is not None:
                p.held.has_model = True
                model_ids, model_q = self._model_part(p, drafted, k)
                # a head that lost the sequence needs the whole context's features: the
                # loop has them (the target's cache of them), the mix does not
                is_miss[i] |= (drafted.is_miss[k] and not self.continues
                               and not p.item.prefill_only)
            miss = is_miss[i]
            ids = p.free + model_ids
            # the model's tree hangs after the looked-up chain (engine/tree.py)
            tree = drafted.parents_of(k)[:len(model_ids)] if model_ids else []
            trees.append(chain(len(p.free)) + [len(p.free) - 1 if q < 0 else q + len(p.free)
                                               for q in tree])
            q = None
            if model_q is not None:  # [n, vocab]: the looked-up part as point masses
                free_ids = torch.tensor(p.free, dtype=torch.long, device=model_q.device)
                q = torch.cat([dense_q(None, free_ids[None], self.vocab_size)[0], model_q])
            rows.append((ids, q))
            sources.append((p.free_kind, len(p.free)))
            ranks.append(drafted.cache_rank(k) if model_ids else 0)
            if p.held is not None and not miss:  # (a tree's first path is what it learns)
                p.held.propose([ids[n] for n in first_path(trees[-1])], len(p.free),
                               p.free_match, p.is_forced)
        is_tree = drafted is not None and drafted.parents is not None
        out = Proposal.of_rows(rows, self.vocab_size, device, sources,
                               trees if is_tree else None) if any(
            ids for ids, _ in rows) else Proposal.empty(len(plans), device)
        out.is_miss = is_miss
        out.cache_ranks = ranks if any(ranks) else []
        if drafted is not None and drafted.prepared:
            out.prepared = [drafted.prepared_for(by_plan[id(p)]) if id(p) in by_plan else {}
                            for p in plans]
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
                self.features.taken(p.item.seq_id, context_len)
            return [], None
        if not g:
            return [], None
        holds_drafts = self.continues and drafted.parents is None  # (not a tree's nodes)
        held.model_len = context_len + (g - 1 if holds_drafts else 0)
        self.features.taken(p.item.seq_id, held.model_len)
        ids = drafted.token_ids[k, :g].tolist()
        q = None if drafted.probs is None else drafted.probs[k, :g]
        return ids, q

    def _retry_misses(self, asked: list[_Plan], drafted: Proposal,
                      device: torch.device) -> Proposal:
        """The model lost some sequences: send each its whole context once."""
        missed = [k for k, miss in enumerate(drafted.is_miss)
                  if miss and not asked[k].item.prefill_only and self.continues]
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


def _choice(p: _Plan, continues: bool) -> tuple[list[int], int]:
    """(looked-up tokens, model γ) for an AUTO round with both at hand. The lookup leads
    when its tokens are at least as likely kept as the model's (its estimate at this
    match length against the request's model estimate): alone when it fills the round
    (no draft call), else continued by the model; otherwise the model drafts alone.
    Expected tokens decide, not a time model: drafting ahead (§2.5) hides the model's
    time in small batches, and in large ones the γ policy turns speculation off."""
    alpha = p.held.acceptance
    if alpha.of_lookup(p.free_match) < alpha.model:
        return [], p.model_max
    return p.free, max(0, p.model_max - len(p.free)) if continues else 0


def _tested(proposed: list[int], committed: list[int]) -> list[tuple[int, float]]:
    """(position, 1.0 kept / 0.0 rejected) of each proposal verification tested: the kept
    prefix and the first one that differs (what followed it was never tested)."""
    kept = next((j for j, (a, b) in enumerate(zip(proposed, committed)) if a != b),
                min(len(proposed), len(committed)))
    return [(j, 1.0 if j < kept else 0.0)
            for j in range(min(kept + 1, len(proposed), len(committed)))]


