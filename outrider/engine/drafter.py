"""The draft model as a proposer: γ tokens for many sequences at once, with a
per-sequence draft KV cache.

It keeps the Proposer contract (proposer.py): it rolls its cache back to the caller's
committed prefix — dropping its own unverified tokens — appends the new tokens and
drafts; a sequence whose prefix it no longer holds answers MISS. The in-process loop and
the draft replica process use this same class.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from outrider.core.grammar import Grammars
from outrider.core.sampling import History
from outrider.engine.features import FeatureTap
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal
from outrider.engine.runner import ForwardRequest, ModelRunner
from outrider.engine.sampling import (
    STREAM_DRAFT,
    logits_to_probs,
    position_uniforms,
    probs_of,
    processed_logits,
    sample_from_probs,
    sibling_stream,
)
from outrider.engine.tree import depths, tree_masks

# How q leaves the drafter (docs/DESIGN.md §3). "dense" stays in-process and "dense_dist" goes
# over a torch.distributed channel, both at full precision; "dense_fp16" rounds q to fp16
# BEFORE sampling, so the draft samples from exactly the distribution it sends;
# "point_mass" proposes the argmax with q = one-hot.
Q_FORMATS = ("dense", "ids", "point_mass", "sparse", "dense_fp16", "dense_dist")


class Drafter:
    """A draft model that proposes (a Proposer)."""

    def takes_guesses(self, kind: str) -> bool:
        return False  # (no lookahead)

    def __init__(self, runner: ModelRunner, evict_lru: bool = False) -> None:
        self.runner = runner
        self.evict_lru = evict_lru
        self.last_used: OrderedDict[object, float] = OrderedDict()  # LRU order, oldest first
        # each sequence's tokens in the KV cache, for the processors that read the history
        self.token_ids: dict[object, list[int]] = {}
        self._committed: dict[object, tuple[int, int]] = {}  # (committed tokens, prompt_len)
        # a released sequence's (tokens, prompt_len, teacher rows by position)
        self.on_served: Callable[[list[int], int, dict], None] | None = None
        self.target_topk = 0  # k of the target's top-k to ask for (0: none)
        self._teacher: dict[object, dict[int, tuple]] = {}  # position -> (ids, logprobs)
        self.version = 0  # the weights' version (online distillation; 0: as loaded)
        # what the target kept of each sequence's last proposal tells how the weights
        # serving do: version -> [tokens drafted, tokens accepted]
        self.live_acceptance: dict[int, list[int]] = {}
        self._proposed: dict[object, tuple[int, list[int]]] = {}  # (position, draft tokens)
        self.num_evicted = 0
        self.num_misses = 0
        # the speculation cache's guesses (draft_worker/spec_cache.py): per sequence, the
        # draft's likeliest tokens at each position of its last chain, `runners_up` each
        self.runners_up = 0
        self.likeliest: dict[object, list[list[int]]] = {}
        # cache-aware sampling: the sampled rows the cache prepares for (`aware_of`) draw
        # from a q whose runners_up + 1 likeliest tokens keep `aware_weight` of their mass
        self.aware_weight = 1.0
        self.aware_of: Callable[[DraftItem], bool] = lambda item: False
        self.expendable: set = set()  # sequences evicted before any other: its stand-ins
        self.grammars = Grammars.for_model(runner.cfg.model_dir, runner.vocab_size,
                                           runner.model_config.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def drafts_trees(self) -> bool:
        return True

    @property
    def prepares_ahead(self) -> bool:
        return False  # (a draft replica's speculation cache does, around it)

    @property
    def method(self) -> str:
        return self.runner.method

    @property
    def reads_target(self) -> FeatureTap | None:
        return getattr(self.runner, "reads", None)  # a HeadRunner's

    def release(self, seq_id, served: bool = True) -> bool:
        """Forget a sequence; its committed tokens (the target's) go to `on_served`
        unless it was not `served` (a speculation cache's stand-in, or one it replaced)."""
        self.last_used.pop(seq_id, None)
        tokens = self.token_ids.pop(seq_id, None)
        num_committed, prompt_len = self._committed.pop(seq_id, (0, 0))
        self._proposed.pop(seq_id, None)
        self.likeliest.pop(seq_id, None)
        self.expendable.discard(seq_id)
        if self.grammars is not None:
            self.grammars.release(seq_id)
        teacher = self._teacher.pop(seq_id, {})
        if self.on_served is not None and tokens and served:
            self.on_served(tokens[:num_committed], prompt_len, teacher)
        found = self.runner.blocks.has(seq_id)
        self.runner.blocks.free(seq_id)
        return found

    def take_over(self, item: DraftItem, stand_in, drafts: list[int]) -> bool:
        """`stand_in` was drafted for the context `item` brings: it becomes `item`'s
        sequence, with `drafts` proposed (its KV holding all but the last, as after
        drafting them). False, nothing changed: the sequence's own state does not allow
        it (the checks of _sync)."""
        blocks, seq_id = self.runner.blocks, item.seq_id
        if not (blocks.has(stand_in) and blocks.has(seq_id)
                and blocks.sealed_len(seq_id) <= item.committed_len <= blocks.seq_len(seq_id)):
            return False
        self._score(item)
        committed = item.committed_len + len(item.new_token_ids)
        teacher = self._teacher.pop(seq_id, None)  # (an adapting draft's, kept)
        self.release(seq_id, served=False)
        if teacher is not None:
            self._teacher[seq_id] = teacher
        if stand_in in self.likeliest:  # at its drafts' positions: the next guesses
            self.likeliest[seq_id] = self.likeliest.pop(stand_in)[:len(drafts)]
        blocks.rename(stand_in, seq_id)
        self.token_ids[seq_id] = self.token_ids.pop(stand_in)[:committed] + drafts[:-1]
        blocks.rollback(seq_id, len(self.token_ids[seq_id]))
        self._committed[seq_id] = (committed, item.prompt_len)
        self._committed.pop(stand_in, None)
        self._proposed.pop(stand_in, None)
        self._proposed[seq_id] = (committed, list(drafts))
        self.expendable.discard(stand_in)
        self.last_used.pop(stand_in, None)
        self.last_used[seq_id] = time.monotonic()
        return True

    def adopt(self, state: dict, version: int | None = None) -> None:
        """Draft with new weights (as `version`; default: the next) from now on. Every
        sequence's KV and every cached prefix came from the old ones: they go, and
        sequences answer MISS and are sent whole. The caller holds the forward lock."""
        for seq_id in list(self.token_ids):
            self.release(seq_id)
        self.runner.blocks.forget_cached()
        self.runner.swap_weights(state)
        self.version = self.version + 1 if version is None else version

    def version_of(self, seq_id) -> int:
        """The weights' version that drafts for `seq_id`."""
        return self.version

    def evict_idle(self, max_idle_s: float) -> int:
        """Free sequences unused for `max_idle_s`; they answer MISS if they come back."""
        now, evicted = time.monotonic(), 0
        while self.last_used and now - next(iter(self.last_used.values())) > max_idle_s:
            self.release(next(iter(self.last_used)))
            evicted += 1
        self.num_evicted += evicted
        return evicted

    def draft(self, items: list[DraftItem], device: torch.device | None = None,
              interrupted: Callable[[], bool] | None = None) -> Proposal:
        """γ tokens (or a tree) per item. `interrupted`, asked before each drafting step,
        ends every chain where it is when it says so (rows then propose fewer)."""
        is_miss = [it.is_active and not self._sync(it) for it in items]
        self.num_misses += sum(is_miss)
        for it in items:
            if it.teacher and self.target_topk and self.runner.blocks.has(it.seq_id):
                self._teacher.setdefault(it.seq_id, {}).update(
                    (p, (ids, lps)) for p, ids, lps in it.teacher)
        protected = {it.seq_id for it in items}
        is_held = [it.is_active and not miss and self._reserve(it, protected)
                   for it, miss in zip(items, is_miss)]
        gammas = [it.gamma if held else 0 for it, held in zip(items, is_held)]
        is_prefilled = [held and it.prefill_only for it, held in zip(items, is_held)]
        self._compile_grammars([it for it, done in zip(items, is_prefilled) if done])
        device = device or self.runner.device
        is_miss = [miss or (it.prefill_only and not done)
                   for it, miss, done in zip(items, is_miss, is_prefilled)]
        in_trees, chains = tree_rows(items, gammas)
        token_ids, probs = self._draft_tokens(items, chains, is_prefilled, device, interrupted)
        proposal = Proposal(token_ids, probs, chains, is_miss)
        if in_trees:  # (their own forwards: a level feeds k nodes where a chain feeds 1)
            trees = self._draft_trees([items[i] for i in in_trees], [gammas[i] for i in in_trees])
            proposal = with_trees(proposal, in_trees, trees, self.vocab_size, device)
        return proposal

    def _compile_grammars(self, prefilled: list[DraftItem]) -> None:
        """Constrained sequences' grammars, compiled as the draft takes in their context
        rather than in their first drafting round: the target's cost model weighs that
        round's time, and compiles there scaled its draft time up (1.7 -> 3.2 ms over a
        benchmark's warm-up). A context taken in drafts nothing, so at 1 stream its step
        adds nothing to the estimate."""
        for item in prefilled:
            if item.params.structured_output is not None and self.grammars is not None:
                self.grammars.check(item.params.structured_output)

    def submit(self, items: list[DraftItem], device: torch.device | None = None,
               beside_target: bool = False) -> PendingProposal:
        """In process there is nothing to overlap with: the draft runs now."""
        out = self.draft(items, device)
        return PendingProposal(lambda: out)

    # -- cache bookkeeping -----------------------------------------------------------------
    def holds(self, item: DraftItem) -> bool:
        """Whether the caller's committed prefix is here (or the item sends the whole
        context): otherwise drafting for it answers MISS."""
        blocks, seq_id = self.runner.blocks, item.seq_id
        return bool(item.new_token_ids) and (item.committed_len == 0 or (
            blocks.has(seq_id)
            and blocks.sealed_len(seq_id) <= item.committed_len <= blocks.seq_len(seq_id)))

    def _sync(self, item: DraftItem) -> bool:
        """Roll the cache back to the caller's committed prefix; False: a MISS. A sequence
        sent whole (committed_len 0) starts on the longest prefix the cache holds."""
        blocks, seq_id = self.runner.blocks, item.seq_id
        if not self.holds(item):
            if item.committed_len and blocks.has(seq_id) \
                    and item.committed_len < blocks.sealed_len(seq_id):
                self.release(seq_id)  # sealed blocks may be shared: never roll back into them
            return False
        if item.committed_len == 0:
            self._start(item)
        else:
            self._score(item)
        blocks.rollback(seq_id, item.committed_len)
        del self.token_ids[seq_id][item.committed_len:]
        blocks.seal(seq_id, self.token_ids[seq_id], item.committed_len)
        self.last_used[seq_id] = time.monotonic()
        self.last_used.move_to_end(seq_id)
        return True

    def _score(self, item: DraftItem) -> None:
        """Count how much of the sequence's last proposal the target kept."""
        proposed = self._proposed.pop(item.seq_id, None)
        if proposed is None:
            return
        position, drafted = proposed
        context = self.token_ids[item.seq_id][:item.committed_len] + item.new_token_ids
        kept = context[position:position + len(drafted)]
        accepted = next((j for j, (k, d) in enumerate(zip(kept, drafted)) if k != d), len(kept))
        counts = self.live_acceptance.setdefault(self.version, [0, 0])
        counts[0] += len(drafted)
        counts[1] += accepted

    def _start(self, item: DraftItem) -> None:
        """Take the cached prefix of a whole context: the item then sends only the rest."""
        self.runner.blocks.free(item.seq_id)
        self._proposed.pop(item.seq_id, None)
        context = item.new_token_ids
        cached = self.runner.blocks.match_prefix(item.seq_id, context)
        self.token_ids[item.seq_id] = context[:cached]
        item.committed_len, item.new_token_ids = cached, context[cached:]

    def _reserve(self, item: DraftItem, protected: set) -> bool:
        """KV room for the new tokens and γ-1 draft positions (the last draft token is
        never fed back); evicts least-recently-used other sequences when allowed."""
        blocks = self.runner.blocks
        fed = item.tree.topk * max(0, item.gamma - 1) if is_tree(item) else item.gamma - 1
        needed = len(item.new_token_ids) + max(0, fed)
        context = item.committed_len + needed + 1
        if context > self.max_model_len:
            return False
        if not blocks.can_append(item.seq_id, needed) and not self._make_room(
                item.seq_id, needed, protected):
            return False
        blocks.append(item.seq_id, needed)
        self.token_ids[item.seq_id] += item.new_token_ids
        self._committed[item.seq_id] = (item.committed_len + len(item.new_token_ids),
                                        item.prompt_len)
        return True

    def _make_room(self, seq_id, needed: int, protected: set) -> bool:
        """Evict least-recently-used unprotected sequences, but only when that would be
        enough: a sequence that cannot fit anyway evicts no one."""
        blocks = self.runner.blocks
        evictable = (sum(blocks.num_exclusive_blocks(s) for s in self.last_used
                         if s not in protected) if self.evict_lru else 0)
        if blocks.blocks_needed(seq_id, needed) > blocks.num_free_blocks + evictable:
            return False
        while not blocks.can_append(seq_id, needed) and self._evict_one(protected):
            pass
        return blocks.can_append(seq_id, needed)

    def _evict_one(self, protected: set) -> bool:
        if not self.evict_lru:
            return False
        victim = next((s for s in (*self.expendable, *self.last_used) if s not in protected),
                      None)
        if victim is None:
            return False
        is_stand_in = victim in self.expendable
        self.release(victim, served=not is_stand_in)
        self.num_evicted += not is_stand_in
        return True

    # -- the drafting chain: γ batched forwards ---------------------------------------------
    def _draft_tokens(self, items: list[DraftItem], gammas: list[int], is_prefilled: list[bool],
                      device: torch.device, interrupted: Callable[[], bool] | None = None):
        """The drafting chain; prefill-only items ride along in its first forward (KV
        only, no logits). A row stops after a token that would end its output (`gammas`
        is cut to what each row drafted): what follows it could never be emitted."""
        max_gamma = max(gammas, default=0)
        drafted: list[list[int]] = [[] for _ in items]
        probs_out = None
        if any(g and not it.params.is_greedy for it, g in zip(items, gammas)):
            probs_out = torch.zeros(len(items), max_gamma, self.vocab_size, device=device)
        blocks = self.runner.blocks
        prefills = [ForwardRequest(it.new_token_ids, it.committed_len,
                                   blocks.block_table(it.seq_id), 0, it.features)
                    for it, done in zip(items, is_prefilled) if done]
        # a head drafts each next token from the hidden state it gave for the one before
        reads, fed_back = self.reads_target is not None, {}
        if prefills and not max_gamma:
            self.runner.forward(prefills)
        stops, stopped = [frozenset(it.params.held_back_ids) for it in items], set()
        for j in range(max_gamma):
            rows = [i for i, g in enumerate(gammas) if g > j and i not in stopped]
            if not rows or (j and interrupted is not None and interrupted()):
                break
            requests = []
            for i in rows:
                it = items[i]
                cached = it.committed_len + (0 if j == 0 else len(it.new_token_ids) + j - 1)
                new = it.new_token_ids if j == 0 else drafted[i][-1:]
                features = (it.features if j == 0 else fed_back[i][None]) if reads else None
                requests.append(ForwardRequest(new, cached, blocks.block_table(it.seq_id), 1,
                                               features))
            logits = self.runner.forward(requests + (prefills if j == 0 else []))  # [len(rows), V]
            logits = _restricted(logits, [items[i] for i in rows])
            if reads:
                hidden = self.runner.model.hidden_out  # [len(rows), hidden]
                fed_back = {i: hidden[k] for k, i in enumerate(rows)}
            tokens, probs = self._pick(logits, [items[i] for i in rows],
                                       self._histories(items, rows, drafted), j,
                                       self._cache_aware if self.aware_weight != 1.0 else None)
            if self.runners_up:
                self._keep_likeliest(logits, [items[i].seq_id for i in rows], j)
            for i, token in zip(rows, tokens.tolist()):
                drafted[i].append(token)
                if token in stops[i]:
                    stopped.add(i)
            if probs_out is None:
                continue
            if probs is None:  # greedy: q is the point mass on the drafted token
                probs_out[rows, j, tokens.to(device)] = 1.0
            else:
                probs_out[rows, j] = probs.to(device)
        for i, (it, d) in enumerate(zip(items, drafted)):  # the KV holds all but the last
            if d:                                             # draft token
                self._proposed[it.seq_id] = (len(self.token_ids[it.seq_id]), d)
                self.token_ids[it.seq_id] += d[:-1]
            if len(d) < gammas[i]:  # stopped, or interrupted: give back the positions
                #                       reserved for the rest of its γ
                gammas[i] = len(d)
                blocks.rollback(it.seq_id, len(self.token_ids[it.seq_id]))
        token_ids = torch.tensor([d + [0] * (max_gamma - len(d)) for d in drafted],
                                 dtype=torch.long, device=device).view(len(items), max_gamma)
        return token_ids, probs_out

    def _cache_aware(self, probs: torch.Tensor, items: list[DraftItem]) -> torch.Tensor:
        """Saguaro's cache-aware sampling (Kumar et al. 2026), for the sampled rows the
        cache prepares for: their runners_up + 1 likeliest tokens keep aware_weight of
        their mass (then renormalised). Where the target rejects a draft it draws from
        max(0, p - q), which then lies mostly on those tokens, the ones the cache's
        stand-ins guess; a draft sampled from this q is accepted a little less often.
        Exact for any weight: verification uses the q the draft was sampled from.
        probs [rows, vocab]."""
        rows = [i for i, it in enumerate(items) if not it.params.is_greedy
                and it.q_format in SHAPEABLE_Q and self.aware_of(it)]
        if not rows:
            return probs
        probs = probs.clone()
        picked = probs[rows]  # [len(rows), vocab]
        top = picked.topk(self.runners_up + 1, dim=-1).indices  # [len(rows), F]
        picked.scatter_(-1, top, picked.gather(-1, top) * self.aware_weight)
        probs[rows] = picked / picked.sum(-1, keepdim=True)
        return probs

    # -- the drafting tree: γ levels of batched forwards (engine/tree.py) -------------------
    def _keep_likeliest(self, logits: torch.Tensor, seq_ids: list, j: int) -> None:
        """Each row's likeliest tokens at drafting step j (logits [rows, vocab])."""
        top = logits.topk(self.runners_up + 1, dim=-1).indices.tolist()  # [rows, k + 1]
        for seq_id, ids in zip(seq_ids, top):
            if j == 0:
                self.likeliest[seq_id] = []
            self.likeliest[seq_id].append(ids)

    def _draft_trees(self, items: list[DraftItem], gammas: list[int]
                     ) -> list[tuple[list[int], list[int], torch.Tensor | None]]:
        """Each item's tree (tokens, parents, and for a sampled item the q each node was
        drawn from [nodes, vocab]), γ levels deep, EAGLE-2's way around the draft's own
        chain (TreeGrowth). Its KV keeps the committed tokens alone."""
        blocks = self.runner.blocks
        grow = {i: TreeGrowth(it) for i, it in enumerate(items)}
        reads = self.reads_target is not None
        for level in range(max(gammas)):
            rows = growing(grow, gammas, level)
            if not rows:
                break
            requests = [grow[i].request(blocks.block_table(items[i].seq_id), level)
                        for i in rows]
            logits = self.runner.forward(requests)  # [expanding nodes of every row, V]
            hidden = self.runner.model.hidden_out if reads else None  # [logit rows, hidden]
            grow_level(grow, rows, items, gammas, level, logits, hidden, self._history)
        for it in items:
            blocks.rollback(it.seq_id, len(self.token_ids[it.seq_id]))
        return [grow[i].tree() for i in range(len(items))]

    def _histories(self, items: list[DraftItem], rows: list[int],
                   drafted: list[list[int]]) -> list[History] | None:
        """Each row's tokens for the processors that read them (None: no row's do)."""
        if not any(items[i].params.reads_history for i in rows):
            return None
        return [self._history(items[i], drafted[i]) for i in rows]

    def _history(self, item: DraftItem, drafted: list[int]) -> History:
        """A constrained row allows what its grammar allows after the committed tokens and
        the drafts before it (docs/DESIGN.md §3.8); a draft without a tokenizer.json
        drafts unconstrained (verification still keeps only what the grammar allows)."""
        tokens = self.token_ids[item.seq_id]  # the committed context while drafting
        so, allowed = item.params.structured_output, None
        if so is not None and self.grammars is not None:
            allowed = self.grammars.next_mask(item.seq_id, so, tokens, item.prompt_len, drafted)
        return History(tokens, item.prompt_len, tuple(drafted), allowed)

    @staticmethod
    def _pick(logits: torch.Tensor, items: list[DraftItem], histories: list[History] | None,
              j: int, shape: Callable | None = None):
        """Draft tokens [num_rows] and the q rows they were sampled from (None: all greedy,
        q = one-hot, no need to build it). The request's processors shape q as they
        shape the target's p, over the same history, drafts included; then `shape`
        (probs, items) may, before q is sent and sampled from."""
        params = [it.params for it in items]
        if all(p.is_greedy for p in params):
            return processed_logits(logits, params, histories).argmax(-1), None
        probs = logits_to_probs(logits, params, histories)  # [rows, vocab]
        probs = _as_sent(probs if shape is None else shape(probs, items),
                         [it.q_format for it in items])
        positions = [it.committed_len + len(it.new_token_ids) + j for it in items]
        uniforms = position_uniforms([it.seed for it in items], positions, STREAM_DRAFT)
        return sample_from_probs(probs, uniforms), probs


def _restricted(logits: torch.Tensor, items: list[DraftItem]) -> torch.Tensor:
    """logits [rows, vocab] with each sampled row's tokens outside its `allowed` out."""
    rows = [k for k, it in enumerate(items) if it.allowed is not None and not it.params.is_greedy]
    if not rows:
        return logits
    allowed = torch.stack([items[k].allowed for k in rows])  # [len(rows), vocab]
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def is_tree(item: DraftItem) -> bool:
    return item.tree is not None and not item.tree.is_chain


def tree_rows(items: list[DraftItem], gammas: list[int]) -> tuple[list[int], list[int]]:
    """(the items that draft trees, every item's chain γ: 0 for those)."""
    in_trees = [i for i, (it, g) in enumerate(zip(items, gammas)) if g and is_tree(it)]
    return in_trees, [0 if i in in_trees else g for i, g in enumerate(gammas)]


class TreeGrowth:
    """One item's tree as it grows: nodes (token, parent, cumulative log-prob, the
    feature its children read), the frontier fed to the next level, and how many nodes
    the draft's KV holds after the committed tokens."""

    def __init__(self, item: DraftItem) -> None:
        self.item, self.shape = item, item.tree
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.features: list[torch.Tensor | None] = []
        self.frontier: list[int] = []  # nodes fed at the next level
        self.chain: list[int] = []      # the greedy chain's nodes (top-1 of top-1 ...)
        self.fed: list[int] = []        # nodes in the KV, in order
        self.qs: list[torch.Tensor | None] = []  # what each was drawn from (sampled)
        self.base = item.committed_len + len(item.new_token_ids)

    def request(self, block_table: list[int], level: int) -> ForwardRequest:
        it = self.item
        if level == 0:
            return ForwardRequest(it.new_token_ids, it.committed_len, block_table, 1,
                                  it.features)
        new = self.frontier
        cached = self.base + len(self.fed)
        self.fed += new
        slot = {node: k for k, node in enumerate(self.fed)}
        fed_parents = [slot.get(self.parents[n], -1) for n in self.fed]
        masks = tree_masks(fed_parents)[-len(new):]
        levels = depths(self.parents)  # (a node's depth: 1 under the committed tokens)
        offsets = [levels[n] - 1 - (len(self.fed) - len(new)) for n in new]
        features = (torch.stack([self.features[n] for n in new])
                    if it.features is not None else None)
        return ForwardRequest([self.tokens[n] for n in new], cached, block_table, len(new),
                              features, tree=(offsets, masks))

    def path(self, node: int) -> list[int]:
        """The tokens from the committed ones to `node` (none for the root)."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def expanding(self) -> list[int]:
        """The nodes whose children the last forward's rows give: the root, or the
        frontier just fed."""
        return [-1] if not self.fed and not self.tokens else self.frontier

    def add_children(self, children: list[list[tuple[int, float]]], q: torch.Tensor | None,
                     hidden: torch.Tensor | None, stops: frozenset, grows_on: bool) -> None:
        """Each expanding node's children (token, log-prob), in order (q [len(expanding),
        vocab]: the distribution a sampled item's were drawn from); then the next
        frontier: the chain's newest node (every first child's) and the k - 1 other best
        new nodes by cumulative log-prob that may grow."""
        k = self.shape.topk
        first_new = len(self.tokens)
        for row, parent in enumerate(self.expanding()):
            base = 0.0 if parent < 0 else self.scores[parent]
            if children[row] and parent == (self.chain[-1] if self.chain else -1):
                self.chain.append(len(self.tokens))  # its first child: the chain goes on
            for token, lp in children[row]:
                self.tokens.append(token)
                self.parents.append(parent)
                self.scores.append(base + lp)
                self.features.append(None if hidden is None else hidden[row])
                self.qs.append(None if q is None else q[row])
        new = [n for n in range(first_new, len(self.tokens)) if self.tokens[n] not in stops]
        tip = [n for n in new if self.chain and n == self.chain[-1]]
        others = sorted((n for n in new if n not in tip), key=lambda n: -self.scores[n])
        self.frontier = sorted(tip + others[:k - len(tip)]) if grows_on else []

    def tree(self) -> tuple[list[int], list[int], torch.Tensor | None]:
        """The kept nodes re-indexed in order, and their q (sampled): all of them, or the
        chain (the draft's own, so a tree keeps what its chain would) and the best
        others by cumulative log-prob, `tokens` in all. A node is kept only after its
        parent and the siblings drawn before it: siblings are a draw without
        replacement, which verification needs whole from the first."""
        keep = list(range(len(self.tokens)))
        if self.shape.tokens and len(keep) > self.shape.tokens:
            kept = set(self.chain[:self.shape.tokens])
            ranked = sorted((n for n in keep if n not in kept), key=lambda n: (-self.scores[n], n))
            while len(kept) < self.shape.tokens:
                n = next((n for n in ranked if n not in kept and self._may_keep(n, kept)), None)
                if n is None:
                    break
                kept.add(n)
            keep = sorted(kept)
        index = {node: k for k, node in enumerate(keep)}
        qs = torch.stack([self.qs[n] for n in keep]) if keep and self.qs[0] is not None else None
        return ([self.tokens[n] for n in keep],
                [-1 if self.parents[n] < 0 else index[self.parents[n]] for n in keep], qs)

    def _may_keep(self, node: int, kept: set[int]) -> bool:
        """Its parent is kept, and the sibling drawn just before it."""
        parent = self.parents[node]
        before = next((m for m in range(node - 1, -1, -1) if self.parents[m] == parent), None)
        return (parent < 0 or parent in kept) and (before is None or before in kept)


def with_trees(proposal: Proposal, rows: list[int],
               trees: list[tuple[list[int], list[int], torch.Tensor | None]],
               vocab_size: int, device: torch.device) -> Proposal:
    """`proposal` with rows `rows` replaced by their trees (tokens, parents, q)."""
    out = proposal.with_rows(rows, Proposal.of_rows(
        [(tokens, q) for tokens, _, q in trees], vocab_size, device,
        parents=[parents for _, parents, _ in trees]))
    out.is_miss = proposal.is_miss
    return out


def growing(grow: dict[int, TreeGrowth], gammas: list[int], level: int) -> list[int]:
    """The items whose trees grow a level `level` (their root, or a frontier to expand)."""
    return [i for i, g in grow.items() if (g.frontier or level == 0) and level < gammas[i]]


def grow_level(grow: dict[int, TreeGrowth], rows: list[int], items: list[DraftItem],
               gammas: list[int], level: int, logits: torch.Tensor,
               hidden: torch.Tensor | None, history: Callable) -> None:
    """One level of the trees of items `rows`: logits [expanding nodes of every row,
    vocab] (hidden: the features their children read, a head's) shaped by each request's
    processors over the node's path (`history(item, path)`), each node's children chosen
    (_children) and added to its tree."""
    owners = [i for i in rows for _ in grow[i].expanding()]
    histories = None
    if any(items[i].params.reads_history for i in rows):
        histories = [history(items[i], grow[i].path(node))
                     for i in rows for node in grow[i].expanding()]
    processed = processed_logits(logits, [items[i].params for i in owners], histories)
    children, q = _children(processed, [items[i] for i in owners],
                            [grow[i].base + level for i in owners],
                            max(grow[i].shape.topk for i in rows))
    offset = 0
    for i in rows:
        n = len(grow[i].expanding())
        grow[i].add_children(children[offset:offset + n],
                             None if q is None else q[offset:offset + n],
                             None if hidden is None else hidden[offset:offset + n],
                             frozenset(items[i].params.held_back_ids), level + 1 < gammas[i])
        offset += n


def _children(processed: torch.Tensor, items: list[DraftItem], positions: list[int],
              k: int) -> tuple[list[list[tuple[int, float]]], torch.Tensor | None]:
    """processed [rows, vocab] (row r expands a node of items[r], drafting the token at
    positions[r]): each row's k children (token, log q), and q [rows, vocab] where any
    item samples. A greedy item's are its top k; a sampled item's are k draws from q
    without replacement, each with the seeded uniform of its position and place (the
    first: the chain's own draw)."""
    logprobs = processed.float().log_softmax(-1)  # [rows, vocab]
    top = logprobs.topk(k, dim=-1)
    children = [list(zip(ids, lps)) for ids, lps in zip(top.indices.tolist(),
                                                       top.values.tolist())]
    sampled = [r for r, it in enumerate(items) if not it.params.is_greedy]
    if not sampled:
        return children, None
    q = torch.zeros_like(logprobs)
    q[sampled] = probs_of(processed[sampled], [items[r].params for r in sampled])
    left, drawn = q[sampled].clone(), []
    seeds, where = [items[r].seed for r in sampled], [positions[r] for r in sampled]
    for j in range(k):
        has_mass = left.sum(-1) > 0  # (fewer than k tokens may have mass)
        ids = sample_from_probs(left, position_uniforms(seeds, where,
                                                        sibling_stream(STREAM_DRAFT, j)))
        drawn.append(torch.where(has_mass, ids, -1))
        left.scatter_(-1, ids[:, None], 0.0)
    for row, ids in zip(sampled, torch.stack(drawn, -1).tolist()):
        ids = [t for t in ids if t >= 0]
        children[row] = list(zip(ids, logprobs[row, ids].tolist()))
    return children, q


# the q formats that carry a drafted row's q as it is (a point mass is its argmax's)
SHAPEABLE_Q = ("dense", "dense_fp16", "sparse")


def _as_sent(probs: torch.Tensor, q_formats: list[str]) -> torch.Tensor:
    """q rows [num_rows, vocab] as the caller will see them; sampling uses these rows."""
    if all(f in ("dense", "ids", "sparse", "dense_dist") for f in q_formats):
        return probs
    probs = probs.clone()
    for row, fmt in enumerate(q_formats):
        if fmt == "dense_fp16":
            probs[row] = probs[row].half().float()
        elif fmt == "point_mass":
            probs[row] = torch.nn.functional.one_hot(probs[row].argmax(), probs.shape[-1])
    return probs
