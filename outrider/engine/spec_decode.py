"""The single-process speculative loop: a draft runner proposes, the target verifies.

One round for a batch of sequences (docs/DESIGN.md §2, steps 2–4):
  1. the draft catches up on committed tokens it has not seen and drafts γ_i tokens,
     batched across sequences;
  2. ONE target forward over every sequence's pending tokens + its γ_i draft tokens;
  3. exact rejection sampling; commit accepted + recovered/bonus; roll both KV caches
     back to what was committed.
γ_i = 0 (or no draft) is plain decoding through the same path.

Overlap (while at most `overlap_max_seqs` sequences speculate): while the target
verifies round r, the draft already drafts round r+1 assuming every draft token of
round r is accepted. Its first token is a
candidate for round r's bonus position, which then verifies it exactly (accept with
min(1, p/q), else sample the residual) instead of sampling a fresh bonus; when it is
accepted, the rest are round r+1's draft tokens and that round sends no Propose. It pays
when the target is latency-bound (small batches); in big batches the drafts thrown away
on rejection cost more than the overlap saves. Sampled sequences overlap only with
overlap_sampled=True: the distribution is the same, the sample a seed gives is not, and
seeded output must not depend on the load.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from outrider.core.sampling import MAX_SEED, History, SamplingParams, TokenLogprob
from outrider.core.stats import SpecStats
from outrider.engine.block_manager import OutOfBlocksError
from outrider.engine.drafter import DraftCall, Drafter, DraftItem, DraftOutput, TeacherRow
from outrider.engine.rejection import dense_draft_probs, greedy_verify, rejection_sample
from outrider.engine.runner import ForwardRequest, ModelRunner
from outrider.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    position_uniforms,
    probs_of,
    processed_logits,
    token_logprobs,
)


class RequestError(ValueError):
    """A prompt the engine cannot run; the message says why."""


@dataclass(frozen=True)
class StepTiming:
    """What a step cost: the γ policy keeps its cost model true with these."""

    batch_tokens: int   # target positions in the forward
    verify_s: float     # the target forward
    max_gamma: int      # the largest γ drafted
    draft_tokens: int   # tokens drafted
    draft_s: float      # time the step waited for the draft


@dataclass
class DraftAhead:
    """Draft tokens for the next round, drafted ahead (overlap) after a bonus-position
    candidate that was accepted."""

    token_ids: list[int]        # [n]
    probs: torch.Tensor | None  # [n, vocab] q they were drafted from (None: point masses)


@dataclass(eq=False)  # a sequence is itself, not its fields: the scheduler's membership
class Sequence:      # tests compared all 15 fields pairwise (3 % of a 32-stream step)
    seq_id: int
    token_ids: list[int]  # prompt + output
    prompt_len: int
    params: SamplingParams
    seed: int
    target_len: int = 0   # positions in the target's KV cache
    draft_len: int = 0    # positions in the draft's KV cache
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    last_round: tuple[int, int] = (0, 0)  # (γ, accepted) of the latest round
    ahead: DraftAhead | None = None  # next round's draft tokens, drafted during this one
    traceparent: str = ""  # W3C trace context of its request, for the draft replica's span
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    num_cached_tokens: int | None = None  # prompt positions the prefix cache gave it, once known
    teacher: list[TeacherRow] = field(default_factory=list)  # top-k rows not yet sent to the draft

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class SpeculativeDecoder:
    def __init__(self, target: ModelRunner, drafter: Drafter | None = None,
                 overlap_max_seqs: int = 0, overlap_sampled: bool = False) -> None:
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise RequestError(
                f"draft and target have different vocabularies "
                f"({drafter.vocab_size} vs {target.vocab_size} tokens)")
        self.target, self.drafter = target, drafter
        self.overlap_max_seqs = overlap_max_seqs if drafter is not None else 0
        self.overlap_sampled = overlap_sampled  # sampled sequences draft ahead too
        self.num_candidates = 0    # bonus-position candidates verified (overlap)
        self.num_ahead_rounds = 0  # rounds whose drafts were drafted during the previous one
        self.eos_token_ids = frozenset(target.model_config.eos_token_ids)
        self.last_timing: StepTiming | None = None
        # a sequence must fit the target's KV cache on its own, or it could never run;
        # past the draft's context it goes on without speculating
        kv_capacity = target.blocks.num_blocks * target.blocks.block_size
        self.max_model_len = min(target.max_model_len, kv_capacity)
        self._next_id = 0

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
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        params = replace(params, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        self._next_id += 1
        return Sequence(self._next_id, [*prompt_ids, *resume_ids], len(prompt_ids), params, seed)

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

    def admit(self, seq: Sequence) -> None:
        """Start a sequence without target KV (new or preempted) on the longest prefix
        of its tokens the cache holds; one still waiting to run extends its match with
        blocks sealed since."""
        blocks, seq_id = self.target.blocks, seq.seq_id
        if not blocks.has(seq_id) or (seq.num_cached_tokens is None
                                      and blocks.seq_len(seq_id) == blocks.sealed_len(seq_id)):
            seq.target_len = blocks.match_prefix(seq_id, seq.token_ids)

    def release(self, seq: Sequence) -> None:
        self.target.blocks.free(seq.seq_id)
        if self.drafter is not None:
            self.drafter.release(seq.seq_id)

    # -- one round -------------------------------------------------------------------------
    def step(self, seqs: list[Sequence], gammas: list[int],
             chunk_lens: list[int] | None = None) -> list[list[int]]:
        """Run one speculative round; returns the tokens each sequence committed.

        chunk_lens caps how many pending tokens a sequence feeds the target this step
        (chunked prefill); a sequence whose pending tokens do not all fit only advances
        its prefill: no draft, no sampling, nothing committed. A request's first token
        comes from its prefill step without speculating (time to first token), while the
        draft takes the context in the background: the next round drafts at once. A
        resumed or recomputed sequence speculates at once, as the run it continues did
        at that position: a seeded sample must not depend on where a run broke."""
        for s in seqs:
            self.admit(s)
            if s.num_cached_tokens is None:
                s.num_cached_tokens = s.target_len
        pending = [len(s.token_ids) - s.target_len for s in seqs]
        feed = pending if chunk_lens is None else [min(p, c) for p, c in zip(pending, chunk_lens)]
        is_ready = [f == p for f, p in zip(feed, pending)]
        wanted = [self.clip_gamma(s, g) if ready else 0
                  for s, g, ready in zip(seqs, gammas, is_ready, strict=True)]
        is_first = [s.num_output == 0 for s in seqs]
        gammas = [0 if first else g for first, g in zip(is_first, wanted)]
        start = time.perf_counter()
        draft_ids, draft_probs, gammas = self._propose(seqs, gammas)
        draft_s = time.perf_counter() - start
        # by default only greedy sequences draft ahead: a verified bonus candidate gives
        # the same token as a fresh argmax, but not the same *sample* (the same
        # distribution), and a seed's output must not depend on the batch's size
        ahead_gammas = [g if self.overlap_sampled or s.params.is_greedy else 0
                        for s, g in zip(seqs, gammas)]
        if not (any(ahead_gammas) and sum(g > 0 for g in gammas) <= self.overlap_max_seqs):
            ahead_gammas = [0] * len(seqs)
        warm = [first and g > 0 for first, g in zip(is_first, wanted)]
        background = self._draft_background(seqs, draft_ids, ahead_gammas, warm)
        start = time.perf_counter()
        logits = self._verify_forward(seqs, draft_ids, gammas, feed, is_ready)
        verify_s = time.perf_counter() - start
        for s, ready in zip(seqs, is_ready):
            if not ready:  # a prefill chunk: its full blocks are final
                self.target.blocks.seal(s.seq_id, s.token_ids, s.target_len)
        ready = [i for i, r in enumerate(is_ready) if r]
        committed: list[list[int]] = [[] for _ in seqs]
        num_draft, next_ahead = list(gammas), {}
        if background is not None:
            start = time.perf_counter()
            out = background.result()
            draft_s += time.perf_counter() - start
            self._note_prefilled(seqs, warm, out.is_miss)
            if any(ahead_gammas):
                draft_ids, draft_probs = self._add_bonus_candidates(
                    seqs, out, draft_ids, draft_probs, num_draft, next_ahead)
        self.last_timing = StepTiming(sum(feed) + sum(gammas), verify_s, max(gammas, default=0),
                                      sum(gammas), draft_s)
        if not ready:
            return committed
        result, processed = self._accept(seqs, ready, gammas, num_draft, logits, draft_ids,
                                         draft_probs)
        for i, k, row in zip(ready, result.num_accepted.tolist(), result.token_ids.tolist()):
            committed[i] = self._commit(seqs[i], gammas[i], k, row, next_ahead.get(i))
        self._note_logprobs(seqs, ready, gammas, processed, committed)
        self._note_teacher(seqs, ready, gammas, logits, committed)
        return committed

    def _accept(self, seqs, ready: list[int], gammas: list[int], num_draft: list[int],
                logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor):
        """Exact verification of the ready sequences; logits: [sum(γ_i + 1), vocab].
        num_draft[i] is γ_i, or γ_i + 1 with a bonus-position candidate (overlap).
        Returns the rejection result and the processed logits it verified with."""
        device, width = draft_ids.device, draft_ids.shape[1] + 1
        rows = torch.tensor(ready, device=device)
        num_rows = [gammas[i] + 1 for i in ready]
        num_verified = torch.tensor([num_draft[i] for i in ready], device=device)
        params = [seqs[i].params for i in ready for _ in range(gammas[i] + 1)]
        histories = None
        if any(seqs[i].params.reads_history for i in ready):
            drafts = draft_ids.tolist()
            histories = [History(seqs[i].token_ids, seqs[i].prompt_len, tuple(drafts[i][:j]))
                         for i in ready for j in range(gammas[i] + 1)]
        processed = processed_logits(logits, params, histories)  # [sum(γ_i + 1), vocab]
        if all(seqs[i].params.is_greedy for i in ready):
            argmax = _pad_rows(processed.argmax(-1), num_rows, width)  # [n, width]
            result = greedy_verify(argmax, draft_ids[rows], num_verified)
        else:
            result = self._rejection_sample(seqs, ready, num_rows, num_verified, processed,
                                            params, draft_ids, draft_probs)
        return result, processed

    def _rejection_sample(self, seqs, ready: list[int], num_rows: list[int],
                          num_verified: torch.Tensor, processed: torch.Tensor, params,
                          draft_ids: torch.Tensor, draft_probs: torch.Tensor | None):
        width = draft_ids.shape[1] + 1
        rows = torch.tensor(ready, device=draft_ids.device)
        if draft_probs is None:  # every draft row is a point mass
            draft_probs = dense_draft_probs(draft_ids, self.target.vocab_size)
        target_probs = _pad_rows(probs_of(processed, params), num_rows, width)
        positions = [[len(seqs[i].token_ids) + j for j in range(width)] for i in ready]
        seeds = [seqs[i].seed for i in ready]
        return rejection_sample(
            target_probs, draft_ids[rows], draft_probs[rows], num_verified,
            position_uniforms(seeds, [p[:-1] for p in positions], STREAM_ACCEPT),
            position_uniforms(seeds, positions, STREAM_SAMPLE))

    @staticmethod
    def _note_logprobs(seqs, ready: list[int], gammas: list[int], processed: torch.Tensor,
                       committed: list[list[int]]) -> None:
        """The committed tokens' logprobs, from the target's verification rows (row j of a
        sequence is its j-th committed token); processed: [sum(γ_i + 1), vocab]."""
        wanted = [(k, i) for k, i in enumerate(ready) if seqs[i].params.logprobs is not None]
        if not wanted:
            return
        flat_rows = _committed_rows(ready, gammas, committed, wanted)
        tokens = torch.tensor([t for _, i in wanted for t in committed[i]], device=processed.device)
        num_top = [seqs[i].params.logprobs for _, i in wanted for _ in committed[i]]
        logprobs = iter(token_logprobs(processed[flat_rows], tokens, num_top))
        for _, i in wanted:
            seqs[i].logprobs += [next(logprobs) for _ in committed[i]]

    def _note_teacher(self, seqs, ready: list[int], gammas: list[int], logits: torch.Tensor,
                      committed: list[list[int]]) -> None:
        """The target's top-k at each committed position, for a draft that distils from
        them (it asked: `target_topk`); logits: [sum(γ_i + 1), vocab], the model's own
        distribution, before the request's sampling processors."""
        k = getattr(self.drafter, "target_topk", 0)
        if not k:
            return
        rows = _committed_rows(ready, gammas, committed, list(enumerate(ready)))
        if not rows:
            return
        top = logits[rows].float().log_softmax(-1).topk(k, dim=-1)  # [rows, k]
        ids, logprobs = iter(top.indices.tolist()), iter(top.values.tolist())
        for i in ready:
            seq, first = seqs[i], len(seqs[i].token_ids) - len(committed[i])
            seq.teacher += [(first + j, tuple(next(ids)), tuple(next(logprobs)))
                            for j in range(len(committed[i]))]

    def draft_version(self, seq: Sequence) -> int:
        """The draft weights' version that drafts for `seq` (0 without a draft)."""
        return self.drafter.version_of(seq.seq_id) if self.drafter is not None else 0

    def clip_gamma(self, seq: Sequence, gamma: int) -> int:
        """γ limited by what the request may still emit and by the contexts of the target
        and the draft (not by load): past the draft's context γ is 0."""
        if self.drafter is None:
            return 0
        room = min(seq.params.max_tokens - seq.num_output,
                   self.max_model_len - len(seq.token_ids))
        draft_room = self.drafter.max_model_len - len(seq.token_ids)
        return max(0, min(gamma, room - 1, draft_room))

    def _propose(self, seqs: list[Sequence], gammas: list[int]):
        """Draft γ_i tokens per sequence (from the previous round's drafting ahead where
        there is one). Returns draft ids [batch, max_gamma], dense q [batch, max_gamma,
        vocab], and the γ actually drafted (0 when the draft could not)."""
        device, vocab = self.target.device, self.target.vocab_size
        aheads = [s.ahead if g else None for s, g in zip(seqs, gammas)]
        for s in seqs:
            s.ahead = None
        to_draft = [0 if a else g for a, g in zip(aheads, gammas)]
        if any(to_draft):
            out = self._draft(seqs, to_draft)
        else:
            out = DraftOutput(torch.zeros(len(seqs), 0, dtype=torch.long, device=device), None,
                              [0] * len(seqs), [False] * len(seqs))
        if any(aheads):
            out = _merge_rows(out, [i for i, a in enumerate(aheads) if a],
                              _ahead_output(aheads, gammas, vocab, device))
            self.num_ahead_rounds += sum(a is not None for a in aheads)
        return out.token_ids, out.probs, out.gammas

    def _draft(self, seqs: list[Sequence], gammas: list[int]) -> DraftOutput:
        """A fresh Propose; sequences the draft has lost resend their whole context once."""
        items = [self._draft_item(s, g) for s, g in zip(seqs, gammas)]
        out = self.drafter.draft(items, self.target.device)
        missed = [i for i, miss in enumerate(out.is_miss) if miss]
        if missed:
            for i in missed:
                seqs[i].draft_len = 0
            retries = [self._draft_item(seqs[i], gammas[i]) for i in missed]
            for i, retry in zip(missed, retries):
                retry.teacher = items[i].teacher
            retry = self.drafter.draft(retries, self.target.device)
            out = _merge_rows(out, missed, retry)
        for s, g in zip(seqs, out.gammas):
            if g:  # the draft now holds the context and its first γ-1 draft tokens
                s.draft_len = len(s.token_ids) + g - 1
        return out

    @staticmethod
    def _draft_item(seq: Sequence, gamma: int, drafts: list[int] = ()) -> DraftItem:
        """Draft after the committed tokens (+ `drafts`, assumed accepted). The draft must
        be sent at least the last token: drafting needs its logits."""
        num_committed = len(seq.token_ids)
        start = min(seq.draft_len, num_committed + len(drafts) - 1)
        new = seq.token_ids[start:] + list(drafts[max(0, start - num_committed):])
        teacher = []
        if gamma:  # the target's top-k rows go with the sequence's next Propose
            teacher, seq.teacher = seq.teacher, []
        return DraftItem(seq.seq_id, start, new if gamma else [], gamma, seq.params, seq.seed,
                         traceparent=seq.traceparent if start == 0 else "",
                         prompt_len=seq.prompt_len, teacher=teacher)

    def _draft_background(self, seqs: list[Sequence], draft_ids: torch.Tensor,
                          ahead_gammas: list[int], warm: list[bool]) -> DraftCall | None:
        """What the draft does while the target verifies: drafting the next round ahead
        (overlap), assuming this round's drafts all pass — 1 bonus-position candidate +
        γ_i draft tokens per sequence —, and taking in the context of sequences whose
        prefill completes now."""
        if not (any(ahead_gammas) or any(warm)):
            return None
        drafts = draft_ids.tolist()
        items = [self._draft_item(s, g + 1 if g else 0, drafts[i][:g])
                 for i, (s, g) in enumerate(zip(seqs, ahead_gammas))]
        for i, s in enumerate(seqs):
            if warm[i]:
                items[i] = DraftItem(
                    s.seq_id, s.draft_len, s.token_ids[s.draft_len:], 0, s.params, s.seed,
                    traceparent=s.traceparent if s.draft_len == 0 else "", prefill_only=True,
                    prompt_len=s.prompt_len)
        return self.drafter.submit(items, self.target.device, beside_target=True)

    @staticmethod
    def _note_prefilled(seqs: list[Sequence], warm: list[bool], is_miss: list[bool]) -> None:
        for s, is_warm, miss in zip(seqs, warm, is_miss):
            if is_warm and not miss:
                s.draft_len = s.target_len  # the whole context, as the target now holds it

    def _add_bonus_candidates(self, seqs, ahead: DraftOutput, draft_ids: torch.Tensor,
                              draft_probs: torch.Tensor | None, num_draft: list[int],
                              next_ahead: dict[int, DraftAhead]):
        """Append each sequence's bonus-position candidate to its draft row (γ_i + 1
        tokens to verify) and keep the rest as next round's drafts."""
        vocab = self.target.vocab_size
        draft_ids = torch.nn.functional.pad(draft_ids, (0, 1))  # [batch, γ_max + 1]
        ahead_probs = ahead.probs
        if draft_probs is not None or ahead_probs is not None:
            draft_probs = torch.nn.functional.pad(  # [batch, γ_max + 1, V]
                _dense(draft_probs, draft_ids[:, :-1], vocab), (0, 0, 0, 1))
            ahead_probs = _dense(ahead_probs, ahead.token_ids, vocab)
        for i, g in enumerate(ahead.gammas):
            if not g:
                continue
            gamma = num_draft[i]
            draft_ids[i, gamma] = ahead.token_ids[i, 0]
            if draft_probs is not None:
                draft_probs[i, gamma] = ahead_probs[i, 0]
            num_draft[i] = gamma + 1
            self.num_candidates += 1
            # the draft now holds the context, this round's drafts and g-1 drafted ahead
            seqs[i].draft_len = len(seqs[i].token_ids) + gamma + g - 1
            if g > 1:
                next_ahead[i] = DraftAhead(ahead.token_ids[i, 1:g].tolist(),
                                           None if ahead_probs is None else ahead_probs[i, 1:g])
        return draft_ids, draft_probs

    def _verify_forward(self, seqs: list[Sequence], draft_ids: torch.Tensor, gammas: list[int],
                        feed: list[int], is_ready: list[bool]) -> torch.Tensor:
        """ONE target forward over all sequences' fed tokens + draft tokens. Returns logits
        [sum over ready sequences of (γ_i + 1), vocab]; a sequence's last row is its bonus row."""
        blocks = self.target.blocks
        inputs = [s.token_ids[s.target_len:s.target_len + n] + draft_ids[i, :g].tolist()
                  for i, (s, g, n) in enumerate(zip(seqs, gammas, feed))]
        if sum(blocks.blocks_needed(s.seq_id, len(x)) for s, x in zip(seqs, inputs)) \
                > blocks.num_free_blocks:
            raise OutOfBlocksError("target KV cache cannot hold this round")
        requests = []
        for s, x, g, ready in zip(seqs, inputs, gammas, is_ready):
            blocks.append(s.seq_id, len(x))
            requests.append(ForwardRequest(x, s.target_len, blocks.block_table(s.seq_id),
                                           g + 1 if ready else 0))
            s.target_len += len(x)
        return self.target.forward(requests)

    def _commit(self, seq: Sequence, gamma: int, num_verified_ok: int, row: list[int],
                ahead: DraftAhead | None) -> list[int]:
        """Commit a round: accepted drafts + the recovered or bonus token. With a bonus-
        position candidate (overlap), num_verified_ok may be γ + 1: the candidate is the
        bonus token, and the drafts made after it are next round's."""
        num_accepted = min(num_verified_ok, gamma)
        is_ahead_kept = num_verified_ok > gamma
        base = len(seq.token_ids)
        seq.stats.record(gamma, num_accepted)
        seq.last_round = (gamma, num_accepted)
        committed = []
        for token in row[:num_accepted + 1]:
            seq.token_ids.append(token)
            committed.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.is_finished:
                break
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
        if is_ahead_kept:
            seq.ahead = ahead
        else:  # the draft's chain and the committed tokens part at the emitted token
            seq.draft_len = min(seq.draft_len, base + num_accepted)
        return committed

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        is_eos = token in self.eos_token_ids and not seq.params.ignore_eos
        if is_eos or token in seq.params.stop_token_ids:
            return "stop"
        if seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None


def _merge_rows(first: DraftOutput, rows: list[int], other: DraftOutput) -> DraftOutput:
    """`other`'s drafts (one per entry of `rows`) in place of those rows of `first`,
    widening γ if needed."""
    max_gamma = max(first.token_ids.shape[1], other.token_ids.shape[1])
    token_ids = torch.nn.functional.pad(first.token_ids, (0, max_gamma - first.token_ids.shape[1]))
    probs = other_probs = None
    if first.probs is not None or other.probs is not None:
        vocab = (first.probs if first.probs is not None else other.probs).shape[-1]
        probs = torch.nn.functional.pad(_dense(first.probs, first.token_ids, vocab),
                                        (0, 0, 0, max_gamma - first.token_ids.shape[1]))
        other_probs = _dense(other.probs, other.token_ids, vocab)
    gammas = list(first.gammas)
    for k, i in enumerate(rows):
        g = other.gammas[k]
        token_ids[i, :g], gammas[i] = other.token_ids[k, :g], g
        if probs is not None:
            probs[i, :g] = other_probs[k, :g]
    return DraftOutput(token_ids, probs, gammas, [False] * len(gammas))


def _ahead_output(aheads: list[DraftAhead | None], gammas: list[int], vocab: int,
                  device: torch.device) -> DraftOutput:
    """The drafted-ahead tokens of the sequences that have them, each cut to its γ."""
    rows = [(a.token_ids[:g], None if a.probs is None else a.probs[:g])
            for a, g in zip(aheads, gammas) if a]
    width = max(len(ids) for ids, _ in rows)
    token_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for k, (ids, _) in enumerate(rows):
        token_ids[k, :len(ids)] = torch.tensor(ids)
    probs = None
    if any(q is not None for _, q in rows):
        probs = dense_draft_probs(token_ids, vocab)
        for k, (ids, q) in enumerate(rows):
            if q is not None:
                probs[k, :len(ids)] = q
    return DraftOutput(token_ids, probs, [len(ids) for ids, _ in rows], [False] * len(rows))


def _dense(probs: torch.Tensor | None, token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """q rows [batch, γ, vocab]: `probs`, or the point masses at `token_ids`."""
    return probs if probs is not None else dense_draft_probs(token_ids, vocab)


def _committed_rows(ready: list[int], gammas: list[int], committed: list[list[int]],
                    which: list[tuple[int, int]]) -> list[int]:
    """The verification rows ([sum over ready of γ_i + 1]) of the committed tokens of
    `which`, (k, i) pairs of ready[k] = i, in order: row j of a sequence verified its
    j-th committed token."""
    offsets = [0, *itertools.accumulate(gammas[i] + 1 for i in ready)]
    return [offsets[k] + j for k, i in which for j in range(len(committed[i]))]

def _pad_rows(values: torch.Tensor, num_rows: list[int], width: int) -> torch.Tensor:
    """[sum(num_rows), ...] rows, sequence after sequence -> [batch, width, ...], zero padded."""
    out = values.new_zeros(len(num_rows), width, *values.shape[1:])
    offset = 0
    for i, n in enumerate(num_rows):
        out[i, :n] = values[offset:offset + n]
        offset += n
    return out
