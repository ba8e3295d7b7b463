"""The single-process speculative loop: a draft runner proposes, the target verifies.

One round for a batch of sequences (DESIGN §2, steps 2–4):
  1. the draft catches up on committed tokens it has not seen and drafts γ_i tokens,
     batched across sequences;
  2. ONE target forward over every sequence's pending tokens + its γ_i draft tokens;
  3. exact rejection sampling; commit accepted + recovered/bonus; roll both KV caches
     back to what was committed.
γ_i = 0 (or no draft) is plain decoding through the same path.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from outrider.engine.block_manager import OutOfBlocksError
from outrider.engine.drafter import Drafter, DraftItem, DraftOutput
from outrider.engine.rejection import greedy_verify, rejection_sample
from outrider.engine.runner import ForwardRequest, ModelRunner
from outrider.engine.sampling import (
    MAX_SEED,
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingParams,
    logits_to_probs,
    position_uniforms,
)


class RequestError(ValueError):
    """A prompt the engine cannot run; the message says why."""


@dataclass
class SpecStats:
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_rounds += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self._grow(num_draft)
        for j in range(num_draft):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def merge(self, other: SpecStats) -> None:
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.drafted_per_position))
        for j, (d, a) in enumerate(zip(other.drafted_per_position, other.accepted_per_position)):
            self.drafted_per_position[j] += d
            self.accepted_per_position[j] += a

    def _grow(self, num_positions: int) -> None:
        missing = num_positions - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position += [0] * missing
            self.accepted_per_position += [0] * missing

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per round: accepted draft tokens + the recovered/bonus token."""
        if not self.num_rounds:
            return 0.0
        return (self.num_accepted_tokens + self.num_rounds) / self.num_rounds


@dataclass
class Sequence:
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
    def __init__(self, target: ModelRunner, drafter: Drafter | None = None) -> None:
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise RequestError(
                f"draft and target have different vocabularies "
                f"({drafter.vocab_size} vs {target.vocab_size} tokens)")
        self.target, self.drafter = target, drafter
        self.eos_token_ids = frozenset(target.model_config.eos_token_ids)
        # a sequence must fit the target's KV cache on its own, or it could never run
        kv_capacity = target.blocks.num_blocks * target.blocks.block_size
        self.max_model_len = min(target.max_model_len, kv_capacity,
                                 drafter.max_model_len if drafter else target.max_model_len)
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
        its prefill: no draft, no sampling, nothing committed."""
        pending = [len(s.token_ids) - s.target_len for s in seqs]
        feed = pending if chunk_lens is None else [min(p, c) for p, c in zip(pending, chunk_lens)]
        is_ready = [f == p for f, p in zip(feed, pending)]
        gammas = [self.clip_gamma(s, g) if ready else 0
                  for s, g, ready in zip(seqs, gammas, is_ready, strict=True)]
        draft_ids, draft_probs, gammas = self._propose(seqs, gammas)
        logits = self._verify_forward(seqs, draft_ids, gammas, feed, is_ready)
        ready = [i for i, r in enumerate(is_ready) if r]
        committed: list[list[int]] = [[] for _ in seqs]
        if not ready:
            return committed
        result = self._accept(seqs, ready, gammas, logits, draft_ids, draft_probs)
        for i, k, row in zip(ready, result.num_accepted.tolist(), result.token_ids.tolist()):
            committed[i] = self._commit(seqs[i], gammas[i], k, row[:k + 1])
        return committed

    def _accept(self, seqs, ready: list[int], gammas: list[int], logits: torch.Tensor,
                draft_ids: torch.Tensor, draft_probs: torch.Tensor):
        """Exact verification of the ready sequences; logits: [sum(γ_i + 1), vocab]."""
        device, width = draft_ids.device, draft_ids.shape[1] + 1
        rows = torch.tensor(ready, device=device)
        ready_gammas = [gammas[i] for i in ready]
        num_draft = torch.tensor(ready_gammas, device=device)
        if all(seqs[i].params.is_greedy for i in ready):
            argmax = _pad_rows(logits.argmax(-1), ready_gammas, width)  # [n, width]
            return greedy_verify(argmax, draft_ids[rows], num_draft)
        params = [seqs[i].params for i in ready for _ in range(gammas[i] + 1)]
        target_probs = _pad_rows(logits_to_probs(logits, params), ready_gammas, width)
        positions = [[len(seqs[i].token_ids) + j for j in range(width)] for i in ready]
        seeds = [seqs[i].seed for i in ready]
        return rejection_sample(
            target_probs, draft_ids[rows], draft_probs[rows], num_draft,
            position_uniforms(seeds, [p[:-1] for p in positions], STREAM_ACCEPT),
            position_uniforms(seeds, positions, STREAM_SAMPLE))

    def clip_gamma(self, seq: Sequence, gamma: int) -> int:
        """γ limited by what the request may still emit and the context (not by load)."""
        if self.drafter is None:
            return 0
        room = min(seq.params.max_tokens - seq.num_output,
                   self.max_model_len - len(seq.token_ids))
        return max(0, min(gamma, room - 1))

    def _propose(self, seqs: list[Sequence], gammas: list[int]):
        """Draft γ_i tokens per sequence. Returns draft ids [batch, max_gamma], dense
        q [batch, max_gamma, vocab], and the γ actually drafted (0 when the draft could not)."""
        if not any(gammas):
            device, vocab = self.target.device, self.target.vocab_size
            return (torch.zeros(len(seqs), 0, dtype=torch.long, device=device),
                    torch.zeros(len(seqs), 0, vocab, device=device), gammas)
        out = self.drafter.draft([self._draft_item(s, g) for s, g in zip(seqs, gammas)],
                                 self.target.device)
        missed = [i for i, miss in enumerate(out.is_miss) if miss]
        if missed:  # the draft lost these prefixes: resend their whole context once
            for i in missed:
                seqs[i].draft_len = 0
            retry = self.drafter.draft([self._draft_item(seqs[i], gammas[i]) for i in missed],
                                       self.target.device)
            out = _merge_retry(out, retry, missed)
        for s, g in zip(seqs, out.gammas):
            if g:  # the draft now holds the context and its first γ-1 draft tokens
                s.draft_len = len(s.token_ids) + g - 1
        return out.token_ids, out.probs, out.gammas

    @staticmethod
    def _draft_item(seq: Sequence, gamma: int) -> DraftItem:
        return DraftItem(seq.seq_id, seq.draft_len, seq.token_ids[seq.draft_len:] if gamma else [],
                         gamma, seq.params, seq.seed)

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

    def _commit(self, seq: Sequence, gamma: int, num_accepted: int,
                emitted: list[int]) -> list[int]:
        base = len(seq.token_ids)
        seq.stats.record(gamma, num_accepted)
        seq.last_round = (gamma, num_accepted)
        committed = []
        for token in emitted:
            seq.token_ids.append(token)
            committed.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.is_finished:
                break
        if seq.is_finished:
            self.release(seq)
            return committed
        # KV keeps the committed prefix; the last emitted token is fed next round. The
        # draft rolls back to `draft_len` itself when it drafts next.
        seq.target_len = base + num_accepted
        self.target.blocks.rollback(seq.seq_id, seq.target_len)
        seq.draft_len = min(seq.draft_len, base + num_accepted)
        return committed

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        is_eos = token in self.eos_token_ids and not seq.params.ignore_eos
        if is_eos or token in seq.params.stop_token_ids:
            return "stop"
        if seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None


def _merge_retry(first: DraftOutput, retry: DraftOutput, rows: list[int]) -> DraftOutput:
    """Put the retried rows' drafts into the first call's output (widening γ if needed)."""
    max_gamma = max(first.token_ids.shape[1], retry.token_ids.shape[1])
    token_ids = torch.nn.functional.pad(first.token_ids, (0, max_gamma - first.token_ids.shape[1]))
    probs = torch.nn.functional.pad(first.probs, (0, 0, 0, max_gamma - first.probs.shape[1]))
    gammas = list(first.gammas)
    for k, i in enumerate(rows):
        g = retry.gammas[k]
        token_ids[i, :g], probs[i, :g], gammas[i] = retry.token_ids[k, :g], retry.probs[k, :g], g
    return DraftOutput(token_ids, probs, gammas, [False] * len(gammas))


def _pad_rows(values: torch.Tensor, gammas: list[int], width: int) -> torch.Tensor:
    """[sum(γ_i + 1), ...] rows, sequence after sequence -> [batch, width, ...], zero padded."""
    out = values.new_zeros(len(gammas), width, *values.shape[1:])
    offset = 0
    for i, g in enumerate(gammas):
        out[i, :g + 1] = values[offset:offset + g + 1]
        offset += g + 1
    return out
