"""The speculative loop: a proposer proposes, the target verifies.

One step for a batch of sequences (docs/DESIGN.md §2.4) runs four phases over one record
per sequence (`Row`), kept together in the step's record (`Step`):
  schedule  what each sequence feeds the target this step and the γ_i it may propose;
  propose   the proposer catches up on committed tokens it has not seen and proposes
            γ_i tokens, batched across sequences;
  verify    ONE target forward over every sequence's fed tokens + its γ_i proposals;
  commit    exact rejection sampling: the accepted proposals + the recovered (or bonus)
            token are committed, and both KV caches roll back to what was committed.
γ_i = 0 (or no proposer) is plain decoding through the same path.

Overlap (while at most `overlap_max_seqs` sequences speculate): while the target
verifies round r, the draft already drafts round r+1 assuming every draft token of
round r is accepted. Its first token is a candidate for round r's bonus position, which
then verifies it exactly (accept with min(1, p/q), else sample the residual) instead of
sampling a fresh bonus; when it is accepted, the rest are round r+1's draft tokens and
that round sends no Propose. It pays when the target is latency-bound (small batches); in
big batches the drafts thrown away on rejection cost more than the overlap saves. Sampled
sequences overlap only with overlap_sampled=True: the distribution is the same, the
sample a seed gives is not, and seeded output must not depend on the load.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch

from outrider.core.grammar import Grammars
from outrider.core.policy import MAX_GAMMA
from outrider.core.sampling import MAX_SEED, History, SamplingParams
from outrider.core.sequence import FinishReason, Round, Sequence
from outrider.core.stats import GRAMMAR_METHOD, MODEL_METHOD
from outrider.core.structured import StructuredOutputError
from outrider.engine.block_manager import OutOfBlocksError
from outrider.engine.features import FeatureLog
from outrider.engine.goodput import CACHE_PAYS, CacheMissChoice
from outrider.engine.mix import ProposerMix
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal, Proposer, dense_q
from outrider.engine.rejection import (
    RejectionResult,
    dense_draft_probs,
    greedy_verify,
    rejection_sample,
    tree_rejection_sample,
)
from outrider.engine.runner import ForwardRequest, ModelRunner
from outrider.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    position_uniforms,
    probs_of,
    processed_logits,
    sample_from_probs,
    sibling_stream,
    token_logprobs,
)
from outrider.engine.tree import (
    TreeChoice,
    TreeShape,
    chain,
    children_of,
    depths,
    first_path,
    row_tree,
    walk,
)

# a head's features of committed tokens it was not sent wait in memory: past this many
# a sequence's are taken in while the target verifies (`_head_backlog`)
HEAD_FEED_TOKENS = 64


class RequestError(ValueError):
    """A prompt the engine cannot run; the message says why."""


@dataclass(frozen=True)
class StepTiming:
    """What a step cost: the γ policy keeps its cost model true with these."""

    batch_tokens: int   # target positions in the forward
    verify_s: float     # the target forward
    max_gamma: int      # the largest γ the draft model drafted (looked-up tokens cost none)
    draft_tokens: int   # tokens the draft model drafted
    draft_s: float      # time the step waited for the proposer
    mask_s: float = 0.0  # time computing grammar masks for its verification rows (§3.8)
    draft_cpu_s: float = 0.0  # of draft_s, this thread's own CPU time (lookups, tensors)
    tree_rounds: int = 0  # rounds verified as token trees, and their nodes
    tree_nodes: int = 0
    is_plain: bool = False  # nothing verified, every sequence decoding one token
    ready_only: bool = False  # its Proposes asked for ready drafts only (CacheMissChoice)
    delivered: int = 0  # rounds whose drafts a speculation cache delivered: no Propose

    @property
    def draft_wait_s(self) -> float:
        """Of draft_s, the time this thread was off its CPU: waiting for the draft."""
        return max(0.0, self.draft_s - self.draft_cpu_s)


@dataclass
class DraftAhead:
    """Draft tokens for the next round, drafted ahead (overlap) after a bonus-position
    candidate that was accepted, or delivered by a speculation cache for the outcome the
    round had (cache_rank > 0)."""

    token_ids: list[int]        # [n]
    probs: torch.Tensor | None  # [n, vocab] q they were drafted from (None: point masses)
    source: tuple[str, int] = ("", 0)  # the first n were looked up (Proposal.source)
    cache_rank: int = 0         # delivered: the rank of the outcome they were drafted for

    @property
    def num_forced(self) -> int:
        """Its first tokens a grammar forced: on top of the next round's γ (§3.8)."""
        return forced_count(self.source)


def forced_count(source: tuple[str, int]) -> int:
    """Of proposals whose first source[1] came from source[0], those a grammar forced."""
    return source[1] if source[0] == GRAMMAR_METHOD else 0


@dataclass
class Row:
    """One sequence's part in a step."""

    index: int             # its place in the batch
    seq: Sequence
    feed: int              # pending tokens it feeds the target this step
    is_ready: bool         # they are all its pending tokens: it verifies and commits now
    is_first: bool         # no output yet: its first token comes without drafting
    wanted: int            # γ asked for, clipped to what it may still emit (0 unless ready)
    gamma: int = 0         # tokens proposed
    source: tuple[str, int] = ("", 0)  # the first of them were looked up (Proposal.source)
    cache_rank: int = 0    # they were prepared ahead for this outcome (Proposal.cache_ranks)
    ahead_gamma: int = 0   # its γ drafted ahead while the target verifies (overlap)
    num_verified: int = 0  # γ, or γ + 1 with a bonus-position candidate (overlap)
    ahead: DraftAhead | None = None  # next round's drafts, kept if the candidate passes
    committed: list[int] = field(default_factory=list)
    parents: list[int] | None = None  # its proposals' tree (engine/tree.py); None: a chain
    path: list[int] | None = None     # the tree's accepted nodes, root first
    feeds_head: int = 0    # a head takes in its first this-many tokens meanwhile
    delivered: bool = False  # its proposals were delivered: no Propose asked for them
    # what a speculation cache delivered beside this round's verification: the tokens the
    # round may commit -> (the next round's drafts, the outcome's rank)
    outcomes: dict[tuple[int, ...], tuple[list[int], int]] = field(default_factory=dict)

    @property
    def tree(self) -> list[int] | None:
        """Its proposals' parents when they branch (a chain's are None: it needs no mask,
        walk or path)."""
        return None if self.parents is None or self.parents == chain(self.gamma) \
            else self.parents

    @property
    def depth(self) -> int:
        """How deep its proposals reach: γ for a chain."""
        return max(depths(self.parents), default=0) if self.parents else self.gamma

    def verified_row(self, j: int) -> int:
        """Of its verification rows (the fed token's, then one per proposal), the one that
        gave its j-th committed token."""
        if self.path is None or j == 0:
            return j
        return self.path[j - 1] + 1

    @property
    def warms_draft(self) -> bool:
        """Its prefill completes now: the draft takes in the context meanwhile."""
        return self.is_first and self.wanted > 0


@dataclass
class Step:
    """One step's record: its rows and the tensors they share."""

    rows: list[Row]
    draft_ids: torch.Tensor | None = None    # [batch, γ_max (+1 with candidates)]
    drafts: list[list[int]] = field(default_factory=list)  # this round's proposals, as lists
    draft_probs: torch.Tensor | None = None  # [batch, γ_max (+1), vocab]; None: point masses
    has_trees: bool = False  # rows' proposals are trees (Row.parents): verified by walking
    background: PendingProposal | None = None  # what the draft does during verification
    # ... or, where it only takes contexts in, what it does after the step: per context,
    # (its item, its sequence, the positions the draft then holds)
    warm: list[tuple[DraftItem, Sequence, int]] = field(default_factory=list)
    logits: torch.Tensor | None = None       # [sum over ready rows of (γ_i + 1), vocab]
    features: torch.Tensor | None = None     # [fed + proposed tokens, width]: a head's
    feature_at: list[tuple[int, int]] = field(default_factory=list)  # per row: its first
    #                                          row of `features`, and that row's position
    # the committed positions' feature cache slots, and their rows of `features`
    cached_features: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    draft_s: float = 0.0
    draft_cpu_s: float = 0.0
    verify_s: float = 0.0
    mask_s: float = 0.0
    ready_only: bool = False  # its Proposes asked for ready drafts only (CacheMissChoice)
    prepare: bool = True  # the speculation cache prepares (CacheMissChoice.prepares) ...
    drafts_ahead: bool = False  # ... but for rows that draft ahead: few sequences ask
    num_delivered: int = 0  # rows whose proposals a speculation cache delivered

    @property
    def ready(self) -> list[Row]:
        return [r for r in self.rows if r.is_ready]

    @property
    def timing(self) -> StepTiming:
        gammas = [r.gamma for r in self.rows]
        # (a tree drafts level by level; delivered drafts cost this step no drafting)
        drafted = [0 if r.delivered else r.depth - r.source[1] for r in self.rows]
        trees = [r.gamma for r in self.rows if r.path is not None]
        return StepTiming(sum(r.feed for r in self.rows) + sum(gammas), self.verify_s,
                          max(drafted, default=0), sum(drafted), self.draft_s, self.mask_s,
                          self.draft_cpu_s, len(trees), sum(trees),
                          not any(gammas) and all(r.feed == 1 for r in self.rows),
                          self.ready_only, self.num_delivered)


class SpeculativeDecoder:
    def __init__(self, target: ModelRunner, drafter: Proposer | None = None,
                 overlap_max_seqs: int = 0, overlap_sampled: bool = False,
                 tree: TreeShape | None = None, choose_trees: bool = True) -> None:
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise RequestError(
                f"draft and target have different vocabularies "
                f"({drafter.vocab_size} vs {target.vocab_size} tokens)")
        self.target, self.drafter = target, drafter  # the drafter: this loop's proposer
        # a head drafts from the target's features of committed positions: it cannot
        # draft ahead of verification, nor take in a prompt before the target has
        self.reads = drafter.reads_target if drafter is not None else None
        # a tree's drafts are chosen, not sampled: drafting ahead continues chains only
        self.tree = tree if tree is not None and not tree.is_chain else None
        # whether greedy requests draft trees this step (None: always), by the seconds
        # a target forward of n positions takes (the replica's cost model sets it)
        self.tree_choice = TreeChoice() if choose_trees else None
        # what a Propose does with the sequences a draft replica's speculation cache misses
        self.cache_misses = (CacheMissChoice() if drafter is not None
                             and drafter.prepares_ahead else None)
        self.verify_seconds: Callable[[int], float] | None = None
        self._trees_now = self.tree is not None
        if self.tree is not None and not (drafter is not None and drafter.drafts_trees):
            raise RequestError(f"tree top-k {tree.topk}: the proposer drafts chains only (a "
                               f"draft model or a head in the target's process drafts "
                               f"trees; draft replicas do not)")
        if self.tree is not None and any(target.model_config.sliding_windows):
            raise RequestError("token trees need a target without a sliding window (its "
                               "window counts positions in the tree's order)")
        self.overlap_max_seqs = (overlap_max_seqs if drafter is not None and not self.reads
                                 and self.tree is None else 0)
        # what the model part of a round counts under (Proposer.method)
        self.model_method = drafter.method if drafter is not None else MODEL_METHOD
        self.features = FeatureLog()  # a head's features, until it takes them
        if self.reads is not None:
            target.keep_features(self.reads)
        self.overlap_sampled = overlap_sampled  # sampled sequences draft ahead too
        self.num_candidates = 0    # bonus-position candidates verified (overlap)
        self.num_ahead_rounds = 0  # rounds whose drafts were drafted during the previous one
        self.eos_token_ids = frozenset(target.model_config.eos_token_ids)
        self.last_timing: StepTiming | None = None
        # a sequence must fit the target's KV cache on its own, or it could never run;
        # past the draft's context it goes on without speculating
        kv_capacity = target.blocks.num_blocks * target.blocks.block_size
        self.max_model_len = min(target.max_model_len, kv_capacity)
        self._ahead: dict[int, DraftAhead] = {}  # seq id -> drafted during its last round
        # sequences whose last Propose had the speculation cache prepare their next round
        # (CacheMissChoice.prepares): only their next one tells its hit rate
        self._prepared: set[int] = set()
        # contexts the draft takes in after a step, joined when it is next asked for
        # anything: (the call, [(sequence, positions it then holds)] in the call's order)
        self._warming: list[tuple[PendingProposal, list[tuple[Sequence, int]]]] = []
        self._next_id = 0
        self.grammars = Grammars.for_model(target.cfg.model_dir, target.vocab_size,
                                           sorted(self.eos_token_ids))
        if isinstance(drafter, ProposerMix) and drafter.grammars is None:
            drafter.grammars = self.grammars  # its lookups keep to constrained requests'

    # -- requests --------------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], params: SamplingParams,
                     resume_ids: list[int] = ()) -> Sequence:
        """A new sequence; `resume_ids` are output tokens already committed elsewhere."""
        if not prompt_ids:
            raise RequestError("prompt is empty")
        vocab = self.target.vocab_size
        for what, ids in (("prompt", prompt_ids), ("resumed", resume_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{what} token id {bad} is outside the vocabulary [0, {vocab})")
        stops = frozenset() if params.ignore_eos else self.eos_token_ids
        if len(resume_ids) >= params.max_tokens or set(resume_ids) & (
                stops | set(params.stop_token_ids)):
            raise RequestError("the resumed tokens already finish this request "
                               "(max_tokens reached or a stop token among them)")
        if len(prompt_ids) + len(resume_ids) >= self.max_model_len:
            resumed = f" (+{len(resume_ids)} resumed)" if resume_ids else ""
            raise RequestError(f"prompt has {len(prompt_ids)} tokens{resumed}; the model's "
                               f"context is {self.max_model_len}")
        self._check_structured(params)
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        params = replace(params, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        self._next_id += 1
        return Sequence(self._next_id, [*prompt_ids, *resume_ids], len(prompt_ids), params, seed)

    def _check_structured(self, params: SamplingParams) -> None:
        so = params.structured_output
        if so is None:
            return
        if self.grammars is None:
            raise RequestError(f"{so.field}: the target's model folder has no tokenizer.json "
                               f"to build grammars with")
        try:
            self.grammars.check(so)
        except StructuredOutputError as exc:
            raise RequestError(str(exc)) from None

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 gamma: int) -> list[Sequence]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.new_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
        running = list(seqs)
        while running:
            self.step(running, [gamma] * len(running))
            running = [s for s in running if not s.is_finished]
        return seqs

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               gamma: int) -> Iterator[tuple[Sequence, list[int]]]:
        """Yield (sequence, tokens committed this round) until the sequence finishes."""
        seq = self.new_sequence(prompt_ids, params)
        while not seq.is_finished:
            yield seq, self.step([seq], [gamma])[0]

    @property
    def reuses_prefixes(self) -> bool:
        """Whether sequences start on cached prefixes: under a head only where the cache
        keeps their features beside their KV (the head reads those of every position,
        docs/DESIGN.md §8.8)."""
        return self.reads is None or self.target.feature_cache is not None

    def admit(self, seq: Sequence) -> None:
        """Start a sequence without target KV (new or preempted) on the longest prefix
        of its tokens the cache holds; one still waiting to run extends its match with
        blocks sealed since. A head gets the prefix's features from the cache."""
        blocks, seq_id = self.target.blocks, seq.seq_id
        if not self.reuses_prefixes:
            return
        if not blocks.has(seq_id) or (seq.num_cached_tokens is None
                                      and blocks.seq_len(seq_id) == blocks.sealed_len(seq_id)):
            seq.target_len = blocks.match_prefix(seq_id, seq.token_ids)
            if self.reads is not None:
                self._refill_features(seq)

    def _refill_features(self, seq: Sequence) -> None:
        """Its feature log from the target's cache of every computed position's (a cached
        prefix, or a head that lost the sequence)."""
        if seq.target_len:
            self.features.add(seq.seq_id, 0, self.target.cached_features(
                seq.seq_id, 0, seq.target_len))

    def release(self, seq: Sequence) -> None:
        self._join_warming()  # (a Release must not overtake the context it frees)
        self.target.blocks.free(seq.seq_id)
        self._ahead.pop(seq.seq_id, None)
        self._prepared.discard(seq.seq_id)
        self.features.drop(seq.seq_id)
        if self.grammars is not None:
            self.grammars.release(seq.seq_id)
        if self.drafter is not None:
            self.drafter.release(seq.seq_id)

    def draft_version(self, seq: Sequence) -> int:
        """The draft weights' version that drafts for `seq` (0 without a draft)."""
        return self.drafter.version_of(seq.seq_id) if self.drafter is not None else 0

    def verify_width(self, gamma: int) -> int:
        """Positions the target verifies for a round of γ (a tree's nodes, in a step of
        trees): what the γ policy prices and the scheduler counts and reserves KV for.
        (A step of chains prices a sampled request's tree as a chain; its KV check
        `_within_kv` trims what does not fit.)"""
        return self.tree.width(gamma) if self.tree is not None and self._trees_now else gamma

    def clip_gamma(self, seq: Sequence, gamma: int) -> int:
        """γ limited by what the request may still emit and by the contexts of the target
        and the draft (not by load): past the draft's context γ is 0."""
        if self.drafter is None:
            return 0
        room = min(seq.params.max_tokens - seq.num_output,
                   self.max_model_len - len(seq.token_ids))
        draft_room = self.drafter.max_model_len - len(seq.token_ids)
        return max(0, min(gamma, room - 1, draft_room))

    # -- one step: schedule -> propose -> verify -> commit --------------------------------
    def step(self, seqs: list[Sequence], gammas: list[int],
             chunk_lens: list[int] | None = None) -> list[list[int]]:
        """Run one speculative round; returns the tokens each sequence committed.

        chunk_lens caps how many pending tokens a sequence feeds the target this step
        (chunked prefill); a sequence whose pending tokens do not all fit only advances
        its prefill: no draft, no sampling, nothing committed. A request's first token
        comes from its prefill step without drafting (time to first token; a grammar's
        opening is proposed with it), while the draft takes the context in the
        background: the next round drafts at once. A
        resumed or recomputed sequence speculates at once, as the run it continues did
        at that position: a seeded sample must not depend on where a run broke."""
        step = self._schedule(seqs, gammas, chunk_lens)
        self._propose(step)
        self._verify(step)
        if step.ready:
            self._commit(step)
        self._send_warm(step)
        if step.cached_features[0]:  # one write a step
            self.target.store_features(step.cached_features[0],
                                       step.features[step.cached_features[1]])
        self.last_timing = step.timing  # after the commit: it times the grammar masks
        if self.tree is not None and self.tree_choice is not None and self.verify_seconds:
            self._choose_trees(step)  # the next step's kind, before its γ and KV are planned
        if self.cache_misses is not None:
            for r in step.ready:
                if r.gamma:
                    self.cache_misses.observe_kept(min(len(r.committed) - 1, r.gamma))
        return [r.committed for r in step.rows]

    def _choose_trees(self, step: Step) -> None:
        """What this step's greedy rounds kept, and what their first children alone kept
        (a tree's chain), into TreeChoice; then its choice for the next step."""
        greedy = [r for r in step.ready if r.gamma and r.seq.params.is_greedy
                  and not r.seq.params.structured_output
                  and not (r.seq.tree and r.seq.tree.is_chain)]  # (chains by request)
        if not greedy:
            return
        choice = self.tree_choice
        for r in greedy:
            chain_kept = _chain_kept(r, step.drafts[r.index])
            choice.observe_round(self._trees_now, min(len(r.committed) - 1, r.depth),
                                 chain_kept)
        choice.observe_draft(self._trees_now, len(greedy), step.draft_s)
        gamma = round(sum(r.depth for r in greedy) / len(greedy))
        self._trees_now = choice.use_tree(len(greedy), gamma, self.tree.width(gamma),
                                          self.verify_seconds)

    def _schedule(self, seqs: list[Sequence], gammas: list[int],
                  chunk_lens: list[int] | None) -> Step:
        """Each sequence's row: the tokens it feeds the target and the γ it may propose."""
        rows = []
        for i, (seq, gamma) in enumerate(zip(seqs, gammas, strict=True)):
            self.admit(seq)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.target_len
            pending = seq.num_pending
            feed = pending if chunk_lens is None else min(pending, chunk_lens[i])
            is_ready = feed == pending
            wanted = self.clip_gamma(seq, gamma) if is_ready else 0
            rows.append(Row(i, seq, feed, is_ready, seq.num_output == 0, wanted))
        return Step(rows)

    def _propose(self, step: Step) -> None:
        """γ_i proposals per row, from the previous round's drafting ahead where there is
        one; then the draft's work during verification starts."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        self._join_warming()
        asked = [0 if r.is_first else r.wanted for r in step.rows]
        aheads = [self._ahead.pop(r.seq.seq_id, None) for r in step.rows]
        aheads = [a if g else None for a, g in zip(aheads, asked)]
        to_draft = [0 if a else g for a, g in zip(aheads, asked)]
        drafts_ahead = step.drafts_ahead = sum(g > 0 for g in asked) <= self.overlap_max_seqs
        step.ready_only = not drafts_ahead and self._ready_only(step.rows, to_draft)
        prepared = [r.seq.seq_id in self._prepared for r in step.rows]
        step.prepare = self.cache_misses is None or self.cache_misses.prepares()
        # (a row that drafts ahead, §2.5, has the cache prepare nothing: drafting ahead's
        # Propose beside the target takes the sequence before its stand-ins could answer)
        prepare = [step.prepare and not (drafts_ahead and self._drafts_ahead(r.seq))
                   for r in step.rows]
        proposal = (self._draft([r.seq for r in step.rows], to_draft, step.ready_only, prepare)
                    if any(to_draft) else Proposal.empty(len(step.rows), self.target.device))
        if any(aheads):
            asked = [g + a.num_forced if a else g for a, g in zip(aheads, asked)]
            drafted = [(a.token_ids[:g], None if a.probs is None else a.probs[:g])
                       for a, g in zip(aheads, asked) if a]
            sources = [(a.source[0], min(a.source[1], g)) for a, g in zip(aheads, asked) if a]
            # (Proposal.source drops the kind of a row left with no looked-up token)
            ahead = Proposal.of_rows(drafted, self.target.vocab_size, self.target.device,
                                     sources)
            ahead.cache_ranks = [a.cache_rank for a in aheads if a]
            proposal = proposal.with_rows([i for i, a in enumerate(aheads) if a], ahead)
            for r, a in zip(step.rows, aheads):
                r.delivered = a is not None and a.cache_rank > 0
            step.num_delivered = sum(r.delivered for r in step.rows)
            self.num_ahead_rounds += len(drafted) - step.num_delivered
        proposal = self._within_kv(step.rows, self._with_openings(step.rows, proposal))
        step.draft_ids, step.draft_probs = proposal.token_ids, proposal.probs
        step.drafts = [ids[:g] for ids, g in zip(proposal.token_ids.tolist(), proposal.gammas)]
        step.has_trees = proposal.parents is not None
        for r, g in zip(step.rows, proposal.gammas):
            r.gamma = r.num_verified = g
            r.source = proposal.source(r.index)
            r.cache_rank = proposal.cache_rank(r.index)
            if step.has_trees:
                r.parents = proposal.parents_of(r.index)
        step.draft_s = time.perf_counter() - start
        step.draft_cpu_s = time.thread_time() - cpu_start
        if self.cache_misses is not None:
            # (rows whose every proposal was looked up asked the model nothing)
            drafted = [(r, was) for r, g, was in zip(step.rows, to_draft, prepared)
                       if g and not (r.gamma and r.source[1] >= r.gamma)]
            measured = [r for r, was in drafted if was]
            delivered = step.num_delivered  # (hits no Propose asked for)
            self.cache_misses.observe(step.ready_only, len(measured) + delivered,
                                      sum(r.cache_rank > 0 for r in measured) + delivered,
                                      step.draft_s)
            for r, _ in drafted:
                (self._prepared.add if prepare[r.index] else self._prepared.discard)(r.seq.seq_id)
        self._start_background(step)

    def _prepared_for(self, seq: Sequence) -> bool:
        """Whether a draft replica's speculation cache prepares the next rounds of `seq`:
        a greedy chain without a grammar (draft_worker/spec_cache.py)."""
        return (seq.params.is_greedy and seq.params.structured_output is None
                and self._tree_for(seq) is None)

    def _ready_only(self, rows: list[Row], gammas: list[int]) -> bool:
        """Whether this step's Proposes ask for what the speculation cache prepared only
        (CacheMissChoice): when every sequence asking is of the kind it prepares for (a
        greedy chain, no grammar); a sampled one would be waited for anyway, and a seeded
        sample must not depend on what was cached."""
        asking = [(r.seq, g) for r, g in zip(rows, gammas) if g]
        if self.cache_misses is None or self.verify_seconds is None or not asking or any(
                not self._prepared_for(seq) for seq, _ in asking):
            return False
        gamma = round(sum(g for _, g in asking) / len(asking))
        return self.cache_misses.ready_only(len(asking), gamma, self.verify_seconds)

    def _join_warming(self) -> None:
        """The contexts the draft took in after earlier steps (their prefills): what it
        now holds. Joined before the draft is asked for anything else, so it takes them
        in order; the step that prefilled neither waited for nor ran beside them (served
        at one stream, waiting added the draft replica's prefill to every first token)."""
        for pending, warmed in self._warming:
            taken = pending.result()
            for (seq, held), miss in zip(warmed, taken.is_miss):
                if not miss:
                    seq.draft_len = held
        self._warming.clear()

    def _with_openings(self, rows: list[Row], proposal: Proposal) -> Proposal:
        """A constrained request's first round proposes what its grammar forces from the
        start (a schema's `{"name":`), verified with its prefill: its first chunk holds
        them, a round sooner. No draft call: the draft takes in the context meanwhile."""
        openings = {r.index: self._forced(r.seq, 0, [])[:r.wanted] for r in rows
                    if r.is_first and r.wanted}  # (the KV the scheduler reserved: γ)
        openings = {i: ids for i, ids in openings.items() if ids}
        if not openings:
            return proposal
        return proposal.with_rows(list(openings), Proposal.of_rows(
            [(ids, None) for ids in openings.values()], self.target.vocab_size,
            self.target.device, [(GRAMMAR_METHOD, len(ids)) for ids in openings.values()]))

    def _within_kv(self, rows: list[Row], proposal: Proposal) -> Proposal:
        """Forced tokens ride on top of γ, past the KV the scheduler reserved (each row's
        fed tokens + γ): when the cache cannot hold them all, each row keeps its first γ
        proposals, and the rest wait for a round with room."""
        blocks = self.target.blocks
        if sum(blocks.blocks_needed(r.seq.seq_id, r.feed + g)
               for r, g in zip(rows, proposal.gammas)) <= blocks.num_free_blocks:
            return proposal
        gammas = [min(g, self.verify_width(r.wanted)) for r, g in zip(rows, proposal.gammas)]
        num_free = [min(n, g) for n, g in zip(proposal.num_free, gammas)]
        parents = None if proposal.parents is None else [  # (a prefix of a tree is one)
            proposal.parents_of(k)[:g] for k, g in enumerate(gammas)]
        return Proposal(proposal.token_ids, proposal.probs, gammas, proposal.is_miss,
                        num_free, proposal.free_kinds, parents)

    def _verify(self, step: Step) -> None:
        """The target forward; then what the draft did meanwhile: prefills taken in, and
        bonus-position candidates added to the rows to verify (overlap)."""
        start = time.perf_counter()
        # where each row's fed tokens start, for a head's features (not known after)
        positions = [r.seq.target_len for r in step.rows] if self.reads is not None else []
        step.logits = self._forward(step.rows, step.drafts, self._draft_beside(step))
        step.verify_s = time.perf_counter() - start
        if self.reads is not None:
            step.features = self.target.features
            offsets = itertools.accumulate((r.feed + len(step.drafts[r.index])
                                            for r in step.rows), initial=0)
            step.feature_at = list(zip(offsets, positions))
        for r in step.rows:
            if not r.is_ready:  # a prefill chunk: its full blocks are final
                self.target.blocks.seal(r.seq.seq_id, r.seq.token_ids, r.seq.target_len)
                self._keep_features(step, r, r.feed)
        if step.background is None:
            return
        start, cpu_start = time.perf_counter(), time.thread_time()
        drafted = step.background.result()
        step.draft_s += time.perf_counter() - start
        step.draft_cpu_s += time.thread_time() - cpu_start
        for r, miss in zip(step.rows, drafted.is_miss):
            if miss:
                continue
            r.outcomes = drafted.prepared_for(r.index)
            if r.delivered and drafted.gammas[r.index]:  # the replica took the outcome in:
                # it holds the context and its answer but the last (_draft), as far as that
                # is verified (only a delivered row's answer is read: no copy a row a round)
                answered = drafted.token_ids[r.index, :drafted.gammas[r.index]].tolist()
                r.seq.draft_len = len(r.seq.token_ids) + min(
                    _common_prefix(answered, step.drafts[r.index]), len(answered) - 1)
            if r.feeds_head:  # the head holds them: their features may go
                r.seq.draft_len = r.feeds_head
                self.features.taken(r.seq.seq_id, r.feeds_head)
            elif r.warms_draft and self.reads is None:  # the context the target held
                # before this step's proposals (a grammar's opening), which the draft
                # never took in
                r.seq.draft_len = r.seq.target_len - len(step.drafts[r.index])
        if any(r.ahead_gamma for r in step.rows):
            self._add_bonus_candidates(step, drafted)

    def _commit(self, step: Step) -> None:
        """Exact verification of the ready rows; each commits its accepted proposals and
        the recovered or bonus token."""
        ready = step.ready
        result, processed = self._accept(step, ready)
        for r, k, tokens in zip(ready, result.num_accepted.tolist(), result.token_ids.tolist()):
            if step.features is not None:  # a head's: the fed tokens' features and the
                # accepted drafts' (before a finished row's release seals its blocks)
                self._keep_features(step, r, r.feed + min(k, r.gamma))
            r.committed = self._commit_row(r, k, tokens)
        self._note_logprobs(ready, processed)
        self._note_teacher(ready, step.logits)
        self._note_guesses(ready, processed)
        begun = time.perf_counter()
        for r in ready:
            self._end_complete_grammar(r)
        if any(r.seq.params.structured_output for r in ready):
            step.mask_s += time.perf_counter() - begun

    def _keep_features(self, step: Step, row: Row, num_committed: int) -> None:
        """A head's features of the row's first `num_committed` positions this step,
        which are now committed (the target computed them over the right context)."""
        if step.features is not None:
            offset, position = step.feature_at[row.index]
            rows = list(range(offset, offset + num_committed))
            if row.path is not None:  # a tree's: its fed tokens', then the path's nodes'
                rows = rows[:row.feed] + [offset + row.feed + n
                                          for n in row.path[:num_committed - row.feed]]
            self.features.add(row.seq.seq_id, position, step.features[rows])
            if self.target.feature_cache is not None:  # (slots now: a finished row's
                slots, stored = step.cached_features  # blocks go with its release)
                slots += self.target.feature_slots(row.seq.seq_id, position, len(rows))
                stored += rows

    # -- propose ---------------------------------------------------------------------------
    def _draft(self, seqs: list[Sequence], gammas: list[int], ready_only: bool = False,
               prepare: list[bool] | None = None) -> Proposal:
        """A fresh Propose; sequences the draft has lost resend their whole context once.
        `prepare`: per sequence, whether a speculation cache prepares its next round."""
        items = [self._draft_item(s, g) for s, g in zip(seqs, gammas)]
        for it, p in zip(items, prepare or [True] * len(items)):
            it.ready_only, it.prepare = ready_only, p
        out = self.drafter.draft(items, self.target.device)
        missed = [i for i, miss in enumerate(out.is_miss) if miss]
        if missed:
            for i in missed:
                seqs[i].draft_len = 0
            retries = [self._draft_item(seqs[i], gammas[i]) for i in missed]
            for i, retry in zip(missed, retries):
                retry.teacher, retry.ready_only, retry.prepare = (items[i].teacher, ready_only,
                                                                  items[i].prepare)
            out = out.with_rows(missed, self.drafter.draft(retries, self.target.device))
        holds_drafts = self.reads is None and self.tree is None
        for s, g in zip(seqs, out.gammas):
            if g:  # the draft now holds the context and its first γ-1 draft tokens (a
                s.draft_len = len(s.token_ids) + (g - 1 if holds_drafts else 0)
                #    head's are re-made from the target's features once verified; a
                #    tree's nodes are not kept)
                self.features.taken(s.seq_id, len(s.token_ids))
        return out

    def request_tree(self, topk: int, tokens: int) -> TreeShape | None:
        """A request's own tree shape (0, 0: the replica's, None), within the replica's."""
        if not topk and not tokens:
            return None
        served = self.tree or TreeShape()
        return served.within(topk or served.topk, tokens)

    def _tree_for(self, seq: Sequence) -> TreeShape | None:
        """The tree a request drafts this step (its own shape, or the replica's): none
        under a grammar (it masks rows along a chain), none for a greedy one in a step of
        chains (TreeChoice)."""
        params = seq.params
        tree = seq.tree or self.tree
        if tree is None or tree.is_chain or params.structured_output is not None or (
                params.is_greedy and not self._trees_now):
            return None
        return tree

    def _draft_item(self, seq: Sequence, gamma: int, drafts: list[int] = ()) -> DraftItem:
        """Draft after the committed tokens (+ `drafts`, assumed accepted). The draft must
        be sent at least the last token: drafting needs its logits."""
        num_committed = len(seq.token_ids)
        start = min(seq.draft_len, num_committed + len(drafts) - 1)
        new = seq.token_ids[start:] + list(drafts[max(0, start - num_committed):])
        teacher, forced, features = [], [], None
        if gamma and self.reads is not None:
            features = self._head_features(seq, start, len(new))
            if features is None:  # lost (a proposer that missed): no head drafts for it
                gamma = 0
        guesses: list[int] = []
        if gamma:  # the target's top-k rows go with the sequence's next Propose
            teacher, seq.teacher = seq.teacher, []
            guesses, seq.guesses = seq.guesses, []
            forced = self._forced(seq, gamma, drafts)
        return DraftItem(seq.seq_id, start, new if gamma else [], gamma, seq.params, seq.seed,
                         traceparent=seq.traceparent if start == 0 else "",
                         prompt_len=seq.prompt_len, teacher=teacher,
                         proposer=seq.round_proposer or seq.proposer,
                         forced=forced, features=features,
                         tree=self._tree_for(seq), guesses=guesses)

    def _head_features(self, seq: Sequence, first_token: int,
                       num_tokens: int) -> torch.Tensor | None:
        """The features that go with those tokens (FeatureLog.rows_for): the log's, else
        — a head that lost the sequence, sent it whole — the target's cache of every
        committed position's (RunnerConfig.feature_width); None: neither holds them."""
        rows = self.features.rows_for(seq.seq_id, first_token, num_tokens)
        if rows is not None or self.target.feature_cache is None:
            return rows
        self._refill_features(seq)
        return self.features.rows_for(seq.seq_id, first_token, num_tokens)

    def _forced(self, seq: Sequence, gamma: int, drafts: list[int]) -> list[int]:
        """What a constrained sequence's grammar forces after its tokens + `drafts`: free
        drafts on top of the round's γ (they are kept with probability ~1 and cost one
        verification row each), as far as its room and MAX_GAMMA allow."""
        so = seq.params.structured_output
        if so is None:
            return []
        room = min(self.clip_gamma(seq, 1 << 30) - len(drafts), MAX_GAMMA) - gamma
        if room <= 0:
            return []
        forced = self.grammars.forced_tokens(seq.seq_id, so, seq.token_ids, seq.prompt_len,
                                             drafts)
        return forced[:room]

    def _prefill_item(self, seq: Sequence) -> DraftItem:
        """Take in the context the draft lacks, drafting nothing (a head: with the
        features the log holds for it, `_head_backlog`)."""
        new = seq.token_ids[seq.draft_len:]
        features = (self.features.rows_for(seq.seq_id, seq.draft_len, len(new))
                    if self.reads is not None else None)
        return DraftItem(seq.seq_id, seq.draft_len, new, 0, seq.params, seq.seed,
                         prefill_only=True, prompt_len=seq.prompt_len,
                         traceparent=seq.traceparent if seq.draft_len == 0 else "",
                         proposer=seq.proposer, features=features)

    def _head_backlog(self, row: Row) -> int:
        """A head's: the committed tokens it takes in while the target verifies (their
        features then leave the log), when a row that drafts nothing — speculation off
        in a hot batch, say — has let HEAD_FEED_TOKENS of them pile up; 0: none."""
        seq = row.seq
        if self.reads is None or row.gamma or not row.is_ready:
            return 0
        num_new = len(seq.token_ids) - seq.draft_len
        if num_new < HEAD_FEED_TOKENS or not self.features.covers(seq.seq_id, seq.draft_len,
                                                                  num_new):
            return 0
        return len(seq.token_ids)

    def _start_background(self, step: Step) -> None:
        """What the draft does while the target verifies: drafting the next round ahead
        (overlap), assuming this round's drafts all pass — 1 bonus-position candidate +
        γ_i draft tokens per sequence —, and taking in the context of sequences whose
        prefill completes now (a head: the tokens its features piled up for)."""
        # by default only greedy sequences draft ahead: a verified bonus candidate gives
        # the same token as a fresh argmax, but not the same *sample* (the same
        # distribution), and a seed's output must not depend on the batch's size
        rows = step.rows
        # (while drafting ahead runs, at most overlap_max_seqs speculating, it answers: at
        # one stream a delivery's stand-ins outlast the verification they are drafted beside;
        # with a cache, only where the step's Proposes left the rows unprepared for it)
        small = (sum(r.gamma > 0 and not r.is_first for r in rows) <= self.overlap_max_seqs
                 and (self.cache_misses is None or step.drafts_ahead))
        delivers = [not small and self._delivers(step, r) for r in rows]
        for r, d in zip(rows, delivers):  # (a first row's proposals are its grammar's opening)
            drafts_ahead = not (r.is_first or d) and self._drafts_ahead(r.seq)
            # this round's γ, less the tokens its grammar forced on top of it: the next
            # round's forced ones come on top again (drafted ahead, they were drafted twice)
            r.ahead_gamma = r.gamma - forced_count(r.source) if drafts_ahead else 0
        if not small:
            for r in rows:
                r.ahead_gamma = 0
        for r in rows:
            r.feeds_head = self._head_backlog(r)
        warms = [r.warms_draft and self.reads is None or r.feeds_head > 0 for r in rows]
        if not any(r.ahead_gamma or w or d for r, w, d in zip(rows, warms, delivers)):
            return
        if self.reads is None and not any(r.ahead_gamma or d for r, d in zip(rows, delivers)):
            # contexts to take in, nothing to draft ahead: sent once the step committed,
            # so the draft's prefill does not share the cores with the target's forward
            step.warm = [(self._prefill_item(r.seq), r.seq, len(r.seq.token_ids))
                         for r, w in zip(rows, warms) if w]
            return
        items = [self._delivery_item(r) if d else self._prefill_item(r.seq) if w else
                 self._draft_item(r.seq, r.ahead_gamma + 1 if r.ahead_gamma else 0,
                                  step.drafts[r.index] if r.ahead_gamma else [])
                 for r, w, d in zip(rows, warms, delivers)]
        self._prepared.update(r.seq.seq_id for r, d in zip(rows, delivers) if d)
        step.background = self.drafter.submit(items, self.target.device, beside_target=True)

    def _drafts_ahead(self, seq: Sequence) -> bool:
        """Whether `seq` drafts ahead in a batch small enough (§2.5): greedy ones, and
        sampled ones when asked."""
        return self.overlap_sampled or seq.params.is_greedy

    def _delivers(self, step: Step, row: Row) -> bool:
        """Whether a draft replica's speculation cache drafts this round's likely outcomes
        of `row` while the target verifies, and delivers them with the answer
        (_delivery_item): a greedy chain the model drafted alone (a lookup's tokens are no
        context the draft planned from), or that was delivered, while the cache pays
        (CacheMissChoice.prepares)."""
        return (self.cache_misses is not None and step.prepare and not row.is_first
                and self._prepared_for(row.seq) and row.source[1] == 0
                and (row.delivered or row.gamma > 0))

    def _delivery_item(self, row: Row) -> DraftItem:
        """A delivered round brings the last one's outcome (the replica's stand-in for it
        becomes the sequence, its drafts those verified now); a Proposed one collects what
        its Propose had the cache prepare."""
        if row.delivered:
            return replace(self._draft_item(row.seq, row.gamma), deliver=True)
        return replace(self._draft_item(row.seq, 0), deliver=True)

    def _send_warm(self, step: Step) -> None:
        """The contexts the draft takes in after this step (_start_background), joined
        before it is next asked for anything (_join_warming)."""
        # (one that finished in this step is released already: not taken in)
        live = [(item, seq, held) for item, seq, held in step.warm if not seq.is_finished]
        if live:
            pending = self.drafter.submit([item for item, _, _ in live], self.target.device,
                                          beside_target=True)
            self._warming.append((pending, [(seq, held) for _, seq, held in live]))

    # -- verify ----------------------------------------------------------------------------
    def _draft_beside(self, step: Step) -> bool:
        """Whether a draft replica's speculation cache prepares, while this step's
        forward runs, the next round of the greedy chains the model drafted for (or left
        without drafts); the forward then leaves it the cores beyond the target's own
        (ModelRunner.forward) — while the cache pays (CACHE_PAYS of the sequences asking
        find their drafts ready): the second core is worth more to a verification than
        stand-ins rarely used. Not for rounds looked up alone: the model has nothing to
        prepare from them. (Drafting ahead runs beside verifications of at most
        overlap_max_seqs sequences, small forwards already.)"""
        cache = self.cache_misses
        return cache is not None and (cache.hit_rate or 0.0) >= CACHE_PAYS and any(
            not r.is_first and self._prepared_for(r.seq)
            and (r.gamma > r.source[1] or step.ready_only and r.wanted and not r.gamma)
            for r in step.rows)

    def _forward(self, rows: list[Row], drafts: list[list[int]], beside_draft: bool = False
                 ) -> torch.Tensor:
        """ONE target forward over all rows' fed tokens + proposals. Returns logits
        [sum over ready rows of (γ_i + 1), vocab]; a row's last one is its bonus row."""
        blocks = self.target.blocks
        inputs = [r.seq.token_ids[r.seq.target_len:r.seq.target_len + r.feed]
                  + drafts[r.index] for r in rows]
        if sum(blocks.blocks_needed(r.seq.seq_id, len(x)) for r, x in zip(rows, inputs)) \
                > blocks.num_free_blocks:
            raise OutOfBlocksError("target KV cache cannot hold this round")
        requests = []
        for r, x in zip(rows, inputs):
            seq = r.seq
            blocks.append(seq.seq_id, len(x))
            tree = row_tree(r.feed, r.tree) if r.tree is not None else None
            requests.append(ForwardRequest(x, seq.target_len, blocks.block_table(seq.seq_id),
                                           r.gamma + 1 if r.is_ready else 0, tree=tree))
            seq.target_len += len(x)
        return self.target.forward(requests, beside_draft)

    def _add_bonus_candidates(self, step: Step, ahead: Proposal) -> None:
        """Append each row's bonus-position candidate to its proposals (γ_i + 1 tokens to
        verify) and keep the rest as next round's drafts."""
        vocab = self.target.vocab_size
        draft_ids = torch.nn.functional.pad(step.draft_ids, (0, 1))  # [batch, γ_max + 1]
        draft_probs, ahead_probs = step.draft_probs, ahead.probs
        if draft_probs is not None or ahead_probs is not None:
            draft_probs = torch.nn.functional.pad(  # [batch, γ_max + 1, V]
                dense_q(draft_probs, step.draft_ids, vocab), (0, 0, 0, 1))
            ahead_probs = ahead.dense_probs(vocab)
        for r, g in zip(step.rows, ahead.gammas):
            if not g:
                continue
            i, gamma = r.index, r.gamma
            draft_ids[i, gamma] = ahead.token_ids[i, 0]
            if draft_probs is not None:
                draft_probs[i, gamma] = ahead_probs[i, 0]
            r.num_verified = gamma + 1
            self.num_candidates += 1
            # the draft now holds the context, this round's drafts and g-1 drafted ahead
            r.seq.draft_len = len(r.seq.token_ids) + gamma + g - 1
            if g > 1:  # the candidate was the first proposal: the lookup's, if it had any
                kind, num_free = ahead.source(i)
                r.ahead = DraftAhead(ahead.token_ids[i, 1:g].tolist(),
                                     None if ahead_probs is None else ahead_probs[i, 1:g],
                                     (kind, max(0, num_free - 1)))
        step.draft_ids, step.draft_probs = draft_ids, draft_probs

    # -- commit ----------------------------------------------------------------------------
    def _accept(self, step: Step, ready: list[Row]) -> tuple[RejectionResult, torch.Tensor]:
        """Exact verification of the ready rows: the rejection result and the processed
        logits [sum(γ_i + 1), vocab] it verified with. A row verifies γ_i proposals, or
        γ_i + 1 with a bonus-position candidate (overlap)."""
        draft_ids = step.draft_ids
        device, width = draft_ids.device, draft_ids.shape[1] + 1
        index = torch.tensor([r.index for r in ready], device=device)
        num_rows = [r.gamma + 1 for r in ready]
        num_verified = torch.tensor([r.num_verified for r in ready], device=device)
        params = [r.seq.params for r in ready for _ in range(r.gamma + 1)]
        histories = None
        if any(r.seq.params.reads_history for r in ready):
            drafts = draft_ids.tolist()
            begun = time.perf_counter()
            histories = [h for r in ready for h in self._histories(r, drafts[r.index][:r.gamma])]
            if any(r.seq.params.structured_output for r in ready):
                step.mask_s = time.perf_counter() - begun
        processed = processed_logits(step.logits, params, histories)  # [sum(γ_i + 1), vocab]
        if all(r.seq.params.is_greedy for r in ready):
            argmax = _pad_rows(processed.argmax(-1), num_rows, width)  # [n, width]
            result = greedy_verify(argmax, draft_ids[index], num_verified)
        else:
            draft_probs = step.draft_probs  # None: every proposal is a point mass
            if draft_probs is None:
                draft_probs = dense_draft_probs(draft_ids, self.target.vocab_size)
            target_probs = _pad_rows(probs_of(processed, params), num_rows, width)
            positions = [[len(r.seq.token_ids) + j for j in range(width)] for r in ready]
            seeds = [r.seq.seed for r in ready]
            result = rejection_sample(
                target_probs, draft_ids[index], draft_probs[index], num_verified,
                position_uniforms(seeds, [p[:-1] for p in positions], STREAM_ACCEPT),
                position_uniforms(seeds, positions, STREAM_SAMPLE))
        if step.has_trees:  # (those rows' chain reading above means nothing)
            self._walk_trees(step, ready, processed, params, result)
        return result, processed

    @staticmethod
    def _walk_trees(step: Step, ready: list[Row], processed: torch.Tensor,
                    params: list[SamplingParams], result: RejectionResult) -> None:
        """Verification of the rows whose proposals are trees (engine/tree.py): a greedy
        row walks down the children carrying the target's argmax (its nodes are point
        masses: this is rejection sampling for them); a sampled row's siblings are draws
        without replacement from their parent's q, verified by recursive rejection
        sampling with the seeded uniforms of each position and sibling."""
        offsets = [0, *itertools.accumulate(r.gamma + 1 for r in ready)]
        argmax = processed.argmax(-1).tolist()  # [sum(γ_i + 1)]
        for k, r in enumerate(ready):
            if r.tree is None:
                continue
            rows, drafts = slice(offsets[k], offsets[k + 1]), step.drafts[r.index]
            if r.seq.params.is_greedy:
                mine = argmax[rows]
                r.path = walk(r.parents, drafts, mine)
                final = mine[r.verified_row(len(r.path))]
            else:
                r.path, final = _sample_tree(r, drafts, probs_of(processed[rows], params[rows]),
                                             step.draft_probs[r.index, :r.gamma])
            emitted = [drafts[n] for n in r.path] + [final]
            result.token_ids[k] = -1
            result.token_ids[k, :len(emitted)] = torch.tensor(emitted)
            result.num_accepted[k] = len(r.path)

    def _histories(self, row: Row, drafted: list[int]) -> list[History]:
        """Its verification rows' histories: row j follows the round's drafted[:j] (in a
        tree, the drafts on the path to its node), and a constrained sequence's row allows
        what its grammar allows there (§3.8)."""
        seq = row.seq
        if row.tree is not None:
            return [History(seq.token_ids, seq.prompt_len, tuple(path), None)
                    for path in _paths(row.parents, drafted)]
        so = seq.params.structured_output
        masks = ([None] * (len(drafted) + 1) if so is None else self.grammars.row_masks(
            seq.seq_id, so, seq.token_ids, seq.prompt_len, drafted))
        return [History(seq.token_ids, seq.prompt_len, tuple(drafted[:j]), mask)
                for j, mask in enumerate(masks)]

    def _commit_row(self, row: Row, num_verified_ok: int, tokens: list[int]) -> list[int]:
        """Commit a round: accepted proposals + the recovered or bonus token. With a bonus-
        position candidate (overlap), num_verified_ok may be γ + 1: the candidate is the
        bonus token, and the drafts made after it are next round's."""
        seq, gamma = row.seq, row.gamma
        num_accepted = min(num_verified_ok, gamma)
        base = len(seq.token_ids)
        committed = []
        for token in tokens[:num_accepted + 1]:
            seq.token_ids.append(token)
            committed.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.is_finished:
                break
        seq.last_round = _round_of(row, num_accepted, len(committed))
        r = seq.last_round
        seq.stats.record(r.gamma, r.num_accepted, r.free_kind, r.num_free, self.model_method)
        if row.path:  # the accepted nodes' KV, packed after the committed tokens
            self.target.move_kv(self.target.blocks.block_table(seq.seq_id), [
                (base + n, base + d) for d, n in enumerate(row.path[:num_accepted]) if n != d])
        # the KV of the tokens before the emitted one is final (the emitted token is
        # fed next round); the draft rolls back to `draft_len` itself when it drafts next
        blocks = self.target.blocks
        if seq.is_finished:
            blocks.seal(seq.seq_id, seq.token_ids, base + num_accepted)
            self.release(seq)
            return committed
        seq.target_len = base + num_accepted
        blocks.rollback(seq.seq_id, seq.target_len)
        blocks.seal(seq.seq_id, seq.token_ids, seq.target_len)
        if num_verified_ok <= gamma:  # the draft's chain and the committed tokens part here
            seq.draft_len = min(seq.draft_len, base + num_accepted)
        elif row.ahead is not None:
            self._ahead[seq.seq_id] = row.ahead
        delivered = row.outcomes.get(tuple(committed))
        if delivered is not None:  # the next round's drafts are here: no Propose for them
            drafts, rank = delivered
            self._ahead[seq.seq_id] = DraftAhead(drafts, None, cache_rank=rank)
        return committed

    def _end_complete_grammar(self, row: Row) -> None:
        """A constrained sequence whose grammar now takes its EOS alone commits it here: the
        target's next row would be that point mass, whatever the sampling, so the round it
        would take (a whole round when the grammar's last token was a bonus or recovered
        one) is saved (§3.8). min_tokens does not hold it back (engine/sampling.py
        `_holds_back`). Not with ignore_eos, or with logprobs (an EOS's logprob is a
        verification row's). The EOS belongs to no round: the sequence's round statistics
        count what the rounds verified."""
        seq = row.seq
        params = seq.params
        if (seq.is_finished or params.structured_output is None or params.ignore_eos
                or params.logprobs is not None):
            return
        eos = self.grammars.forced_end(seq.seq_id, params.structured_output, seq.token_ids,
                                       seq.prompt_len)
        if eos is None:
            return
        seq.token_ids.append(eos)
        row.committed.append(eos)
        seq.finish_reason = self._finish_reason(seq, eos)  # STOP: ignore_eos is off
        self.release(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        is_eos = token in self.eos_token_ids and not seq.params.ignore_eos
        if is_eos or token in seq.params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _note_logprobs(ready: list[Row], processed: torch.Tensor) -> None:
        """The committed tokens' logprobs, from the target's verification rows (row j of a
        sequence is its j-th committed token); processed: [sum(γ_i + 1), vocab]."""
        wanted = [k for k, r in enumerate(ready) if r.seq.params.logprobs is not None]
        if not wanted:
            return
        tokens = torch.tensor([t for k in wanted for t in ready[k].committed],
                              device=processed.device)
        num_top = [ready[k].seq.params.logprobs for k in wanted for _ in ready[k].committed]
        logprobs = iter(token_logprobs(processed[_committed_rows(ready, wanted)], tokens,
                                       num_top))
        for k in wanted:
            ready[k].seq.logprobs += [next(logprobs) for _ in ready[k].committed]

    def _note_teacher(self, ready: list[Row], logits: torch.Tensor) -> None:
        """The target's top-k at each committed position, for a draft that distils from
        them (it asked: `target_topk`); logits: [sum(γ_i + 1), vocab], the model's own
        distribution, before the request's sampling processors."""
        k = self.drafter.target_topk if self.drafter is not None else 0
        rows = _committed_rows(ready, range(len(ready))) if k else []
        if not rows:
            return
        top = logits[rows].float().log_softmax(-1).topk(k, dim=-1)  # [rows, k]
        ids, logprobs = iter(top.indices.tolist()), iter(top.values.tolist())
        for r in ready:
            first = len(r.seq.token_ids) - len(r.committed)
            r.seq.teacher += [(first + j, tuple(next(ids)), tuple(next(logprobs)))
                              for j in range(len(r.committed))]

    def _note_guesses(self, ready: list[Row], processed: torch.Tensor) -> None:
        """The target's own tokens at each chain's verification rows past its committed
        tokens: predictions for the positions after them, made beside drafts it
        rejected (Jacobi iteration's next guesses), for a proposer that takes them. A
        sampled row's are drawn with the uniforms the target will sample those positions
        with (rejection.py): where the guess's context turns out right, it is the token."""
        if self.drafter is None:
            return
        offsets = itertools.accumulate((r.gamma + 1 for r in ready), initial=0)
        for r, start in zip(ready, offsets):
            seq = r.seq
            seq.guesses = []
            first, end = start + len(r.committed), start + r.gamma + 1  # past the last
            # committed token's row, to the row's last
            if (first >= end or r.path is not None or seq.is_finished
                    or not self.drafter.takes_guesses(seq.proposer)):
                continue
            if seq.params.is_greedy:
                seq.guesses = processed[first:end].argmax(-1).tolist()
                continue
            positions = range(len(seq.token_ids), len(seq.token_ids) + end - first)
            seq.guesses = sample_from_probs(
                probs_of(processed[first:end], [seq.params] * (end - first)),
                position_uniforms([seq.seed], [list(positions)], STREAM_SAMPLE)[0]).tolist()


def _sample_tree(row: Row, drafts: list[int], target_probs: torch.Tensor,
                 draft_probs: torch.Tensor) -> tuple[list[int], int]:
    """A sampled row's tree: target_probs [γ + 1, vocab], draft_probs [γ, vocab]."""
    seq, depth = row.seq, row.depth
    positions = [len(seq.token_ids) + d for d in range(depth + 1)]
    width = max(map(len, children_of(row.parents).values()))
    accept = torch.stack([position_uniforms([seq.seed], [positions],
                                            sibling_stream(STREAM_ACCEPT, j))[0]
                          for j in range(width)], -1)  # [depth + 1, siblings]
    sample = position_uniforms([seq.seed], [positions], STREAM_SAMPLE)[0]
    return tree_rejection_sample(row.parents, drafts, target_probs,
                                 draft_probs, accept, sample)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _chain_kept(row: Row, drafts: list[int]) -> int:
    """Of a round's drafts down its first children (the whole chain, in a chain), how
    many the committed tokens kept."""
    chain_nodes = first_path(row.parents) if row.parents else range(row.gamma)
    kept = row.committed[:-1]
    return next((j for j, n in enumerate(chain_nodes)
                 if j >= len(kept) or drafts[n] != kept[j]), len(chain_nodes))


def _round_of(row: Row, num_accepted: int, num_committed: int) -> Round:
    """The round as its statistics count it. An output that ended at an accepted proposal
    (EOS, a stop token, a finished grammar) ends the round there: the proposals after it
    were never a chance to be kept (a draft past a grammar's end proposes EOS again and
    again, and counting those as kept would inflate acceptance)."""
    gamma, (kind, num_free) = row.depth, row.source
    if num_committed <= num_accepted:
        gamma = num_accepted = num_committed
    num_free = min(num_free, gamma)
    return Round(gamma, num_accepted, kind if num_free else "", num_free,
                 row.gamma if row.tree is not None else 0, row.cache_rank)


def _committed_rows(ready: list[Row], which: Iterable[int]) -> list[int]:
    """The verification rows ([sum over ready of γ_i + 1]) of the committed tokens of
    ready[k] for k in `which`, in order (Row.verified_row)."""
    offsets = [0, *itertools.accumulate(r.gamma + 1 for r in ready)]
    return [offsets[k] + ready[k].verified_row(j) for k in which
            for j in range(len(ready[k].committed))]


def _paths(parents: list[int], drafts: list[int]) -> list[list[int]]:
    """The drafts before each verification row of a tree: none before the fed token's,
    then for node n those on the path to n, n's own included."""
    paths: list[list[int]] = [[]]
    for node, p in enumerate(parents):
        paths.append(paths[p + 1] + [drafts[node]])
    return paths


def _pad_rows(values: torch.Tensor, num_rows: list[int], width: int) -> torch.Tensor:
    """[sum(num_rows), ...] rows, sequence after sequence -> [batch, width, ...], zero padded.
    One scatter, not a copy per sequence (64 of them a 64-stream decode step)."""
    if all(n == width for n in num_rows):  # nothing to pad (a decode step: width 1)
        return values.view(len(num_rows), width, *values.shape[1:])
    counts = torch.tensor(num_rows, device=values.device)
    seq = torch.repeat_interleave(torch.arange(len(num_rows), device=values.device), counts)
    col = torch.arange(len(values), device=values.device) - (counts.cumsum(0) - counts)[seq]
    out = values.new_zeros(len(num_rows), width, *values.shape[1:])
    out[seq, col] = values
    return out
