"""Online distillation of a draft model on the traffic it drafts for (docs/DESIGN.md §8.6).

Every sequence a draft replica serves ends with its committed tokens: the target's own
output, verified, and, where the target sent them, its top-k probabilities at those
positions. They are the training data: cross-entropy of the draft on the target's output
tokens plus, where there are top-k rows, cross-entropy on the target's top-k distribution
(renormalised), given everything before them (the prompt conditions, it is not learned).
A `Distiller` trains a copy of the draft on a bounded buffer of recent sequences and
offers the copy only when it predicts the target's tokens better than the serving
weights on held-out recent sequences (teacher-forced top-1 agreement: the acceptance of
greedy drafting, position by position). Any draft keeps speculative decoding exact, so
adopting one changes speed, never output.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from outrider.engine.attention import soft_capped_sdpa
from outrider.engine.model import CausalLM
from outrider.engine.runner import ModelRunner


@dataclass(frozen=True)
class DistillConfig:
    buffer_tokens: int = 200_000   # recent traffic kept (the oldest sequences go first)
    round_tokens: int = 4_000      # new output tokens that start a training round
    steps_per_round: int = 20
    batch: int = 8                 # windows per step
    window: int = 256              # positions per window
    lr: float = 1e-4
    target_topk: int = 16          # the target's top-k rows asked for (0: its tokens only)
    holdout_every: int = 5         # every 5th sequence is held out, never trained on
    heldout_eval: int = 64         # the most recent held-out sequences a round checks on
    max_duty: float = 0.3          # at most this share of wall time spent training
    # the trained copy is adopted only when it beats the serving weights on held-out
    # positions by this many standard errors (a paired sign test) ...
    min_evidence: float = 1.0
    # ... and agrees with the target on at least this share of them: traffic nothing can
    # be learnt from (random tokens) never passes, however its few hits fall
    min_agreement: float = 0.1
    rollback_tokens: int = 2_000   # live draft tokens a new version is judged on ...
    rollback_margin: float = 0.03  # ... rolled back if its acceptance is this much lower

    def __post_init__(self) -> None:
        if not 0 < self.max_duty <= 1:
            raise ValueError(f"max_duty must be in (0, 1], got {self.max_duty}")
        if min(self.buffer_tokens, self.round_tokens, self.steps_per_round, self.batch,
               self.window, self.holdout_every, self.heldout_eval,
               self.rollback_tokens) < 1 or self.lr <= 0:
            raise ValueError("distillation sizes and lr must be positive")
        if self.min_evidence < 0 or self.target_topk < 0 or not (
                0 <= self.rollback_margin <= 1 and 0 <= self.min_agreement <= 1):
            raise ValueError("min_evidence and target_topk must be >= 0, rollback_margin "
                             "and min_agreement in [0, 1]")


@dataclass(frozen=True, eq=False)
class Teacher:
    """The target's top-k at some positions of a sequence (compact: kept for 200K tokens)."""

    positions: torch.Tensor  # [n] int64: indices into the sequence's tokens
    ids: torch.Tensor        # [n, k] int32
    logprobs: torch.Tensor   # [n, k] float16

    @classmethod
    def from_rows(cls, rows: dict, k: int, length: int) -> Teacher | None:
        """From position -> (ids, logprobs) as sent; rows with fewer than k go."""
        kept = sorted((p, ids[:k], lps[:k]) for p, (ids, lps) in rows.items()
                      if 0 <= p < length and len(ids) >= k and len(lps) >= k)
        if not (k and kept):
            return None
        return cls(torch.tensor([r[0] for r in kept]),
                   torch.tensor([r[1] for r in kept], dtype=torch.int32),
                   torch.tensor([r[2] for r in kept], dtype=torch.float16))

    def cropped(self, start: int, end: int) -> Teacher | None:
        keep = (self.positions >= start) & (self.positions < end)
        if not keep.any():
            return None
        return Teacher(self.positions[keep] - start, self.ids[keep], self.logprobs[keep])


@dataclass(frozen=True)
class Served:
    """One finished sequence: its tokens, where the prompt ends, and the target's top-k
    where it sent them."""

    token_ids: tuple[int, ...]
    prompt_len: int
    teacher: Teacher | None = None

    def cropped(self, start: int, end: int) -> Served:
        """token_ids[start:end], the prompt and the rows with them."""
        return Served(self.token_ids[start:end], max(0, self.prompt_len - start),
                      self.teacher.cropped(start, end) if self.teacher else None)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


class TrafficBuffer:
    """Recent served sequences, bounded in tokens; every `holdout_every`-th goes to the
    held-out side. Thread-safe enough for one writer and one reader (deque appends)."""

    def __init__(self, cfg: DistillConfig) -> None:
        self.cfg = cfg
        self.train: deque[Served] = deque()
        self.heldout: deque[Served] = deque()
        self.num_added = 0
        self.new_output_tokens = 0  # since the last round
        self._tokens = 0

    def add(self, token_ids: list[int], prompt_len: int, teacher: dict | None = None) -> None:
        """A released sequence; `teacher`: position -> (top-k ids, logprobs)."""
        if len(token_ids) - prompt_len < 2:
            return  # nothing to learn from
        rows = Teacher.from_rows(teacher or {}, self.cfg.target_topk, len(token_ids))
        served = Served(tuple(token_ids), prompt_len, rows).cropped(
            max(0, len(token_ids) - self.cfg.window * 4), len(token_ids))
        self.num_added += 1
        side = self.heldout if self.num_added % self.cfg.holdout_every == 0 else self.train
        side.append(served)
        self._tokens += len(served.token_ids)
        self.new_output_tokens += served.num_output
        while self._tokens > self.cfg.buffer_tokens and len(self.train) > 1:
            self._tokens -= len(self.train.popleft().token_ids)
        while len(self.heldout) > max(8, len(self.train) // self.cfg.holdout_every):
            self._tokens -= len(self.heldout.popleft().token_ids)

    def is_ready(self) -> bool:
        return self.new_output_tokens >= self.cfg.round_tokens and bool(self.heldout)


def causal_logits(model: CausalLM, input_ids: torch.Tensor,
                  at: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, T] -> logits [batch, T, vocab] (or [n, vocab] at the positions `at`, bool
    [batch, T], selects: the vocabulary projection is most of a small model's cost): one
    causal pass with no KV cache, through the same modules the engine serves with
    (differentiable when their weights are)."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).repeat(batch)
    x = model.embed(input_ids.reshape(-1))  # [batch * T, hidden]
    for layer, cos_sin in zip(model.layers, model.rotations(positions, x.dtype), strict=True):
        x = layer.around(x, lambda h, layer=layer, cos_sin=cos_sin: _attention(
            layer.self_attn, h, cos_sin, batch, length))
    if at is not None:
        return model.logits(model.norm(x[at.reshape(-1)]))  # [n, vocab]
    return model.logits(model.norm(x)).view(batch, length, -1)


def _attention(attn, x: torch.Tensor, cos_sin, batch: int, length: int) -> torch.Tensor:
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    split = lambda t: t.reshape(batch, length, -1, dim).transpose(1, 2)  # noqa: E731
    q, k, v = map(split, attn.queries_keys_values(x, cos_sin))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # [b, H, T, D]
    mask = None
    if attn.window:
        pos = torch.arange(length, device=x.device)
        mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < attn.window)
    attend = (partial(soft_capped_sdpa, softcap=attn.softcap) if attn.softcap
              else F.scaled_dot_product_attention)
    out = attend(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(batch * length, heads * dim))


def trainable_copy(runner: ModelRunner, state: dict | None = None) -> CausalLM:
    """The runner's model with `state`'s weights (None: its checkpoint's), in a form that
    trains: plain (not prepacked) linears, gradients on every parameter."""
    model = runner.build_model(state)
    for p in model.parameters():
        p.requires_grad_(True)
    return model.train()


def output_mask(seqs: list[Served], length: int) -> torch.Tensor:
    """[batch, length - 1] True where position t + 1 is an output token (the target's)."""
    mask = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    for i, s in enumerate(seqs):
        mask[i, max(0, s.prompt_len - 1):len(s.token_ids) - 1] = True
    return mask


def teacher_targets(seqs: list[Served], length: int, k: int):
    """The target's top-k rows as training targets at logit positions [batch, length - 1]:
    ids [b, length - 1, k], renormalised probabilities [b, length - 1, k], and where there
    are rows [b, length - 1] (the logits at t predict the token at t + 1)."""
    ids = torch.zeros(len(seqs), length - 1, k, dtype=torch.long)
    logprobs = torch.zeros(len(seqs), length - 1, k)
    has = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    for i, s in enumerate(seqs):
        t = s.teacher.cropped(1, length) if s.teacher is not None and k else None
        if t is not None and t.ids.shape[1] >= k:
            at = t.positions  # cropped from 1: the logits one position earlier
            ids[i, at], logprobs[i, at], has[i, at] = t.ids[:, :k].long(), \
                t.logprobs[:, :k].float(), True
    return ids, logprobs.softmax(-1), has


def _predicting(mask: torch.Tensor) -> torch.Tensor:
    """[b, T - 1] (predicts the token at t + 1) -> [b, T] (the logits at t)."""
    return F.pad(mask, (0, 1))


def _padded(seqs: list[Served], length: int) -> torch.Tensor:
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s.token_ids)] = torch.tensor(s.token_ids[:length])
    return ids


@torch.no_grad()
def agreed(model: CausalLM, seqs: list[Served]) -> torch.Tensor:
    """Teacher-forced top-1 agreement with the target's output tokens, position by
    position: bool [output positions of every sequence], True where greedy drafting
    would propose exactly the token the target produced."""
    rows = [torch.zeros(0, dtype=torch.bool)]
    for s in seqs:
        ids = _padded([s], len(s.token_ids))
        mask = output_mask([s], len(s.token_ids))  # [1, T - 1]
        predicted = causal_logits(model, ids, _predicting(mask)).argmax(-1)  # [n]
        rows.append(predicted == ids[:, 1:][mask])
    return torch.cat(rows)


def agreement(model: CausalLM, seqs: list[Served]) -> float:
    """The share of output positions `agreed`."""
    return _share(agreed(model, seqs))


def _share(hits: torch.Tensor) -> float:
    return float(hits.float().mean()) if len(hits) else 0.0


def is_better(old: torch.Tensor, new: torch.Tensor, min_evidence: float) -> bool:
    """Paired sign test on the positions where exactly one of two models agrees: `new`
    wins by more than `min_evidence` standard errors."""
    wins, losses = int((new & ~old).sum()), int((old & ~new).sum())
    return wins > losses and wins - losses > min_evidence * (wins + losses) ** 0.5


@dataclass(frozen=True)
class Verdict:
    """A round's outcome on the held-out traffic."""

    weights: dict | None       # the student's, when they beat the serving weights
    serving_agreement: float
    trained_agreement: float
    is_astray: bool            # the student does worse: restart it from the serving weights


class Distiller:
    """A training copy of the draft; `train_round` returns the copy's weights when they
    beat `serving`'s on the held-out traffic, else None (the serving draft stays)."""

    def __init__(self, runner: ModelRunner, cfg: DistillConfig, seed: int = 0) -> None:
        if runner.model_config.quantization is not None:  # its packed layers are frozen
            raise ValueError(f"{runner.model_name}: a quantized draft cannot learn while it "
                             f"serves: serve its unquantized weights to adapt it")
        self.runner, self.cfg = runner, cfg
        self.rng = random.Random(seed)
        self.num_steps = 0
        self.busy_s = 0.0
        self.restart(None)

    def restart(self, state: dict | None) -> None:
        """Train on from `state` (the weights serving; None: the checkpoint's), with a
        fresh optimizer: after a takeover, a rollback, or a student gone astray."""
        self.student = trainable_copy(self.runner, state)
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=self.cfg.lr,
                                           weight_decay=0.0)

    def train_round(self, buffer: TrafficBuffer, serving: CausalLM,
                    tick=lambda: None) -> Verdict:
        """Some steps on the buffer (`tick()` after each), then the held-out check."""
        buffer.new_output_tokens = 0
        for _ in range(self.cfg.steps_per_round):
            self._step(list(buffer.train))
            tick()
        heldout = list(buffer.heldout)[-self.cfg.heldout_eval:]
        old, new = agreed(serving, heldout), agreed(self.student.eval(), heldout)
        self.student.train()
        old_share, new_share = _share(old), _share(new)
        weights = None
        if new_share >= self.cfg.min_agreement and is_better(old, new, self.cfg.min_evidence):
            weights = {k: v.detach().clone() for k, v in self.student.state_dict().items()}
        return Verdict(weights, old_share, new_share,
                       is_astray=is_better(new, old, self.cfg.min_evidence))

    def _step(self, pool: list[Served]) -> None:
        if not pool:
            return
        start = time.perf_counter()
        seqs = [self._window(self.rng.choice(pool)) for _ in range(self.cfg.batch)]
        length = max(len(s.token_ids) for s in seqs)
        ids = _padded(seqs, length)
        mask = output_mask(seqs, length)  # [b, T - 1]
        logprobs = causal_logits(self.student, ids, _predicting(mask)).log_softmax(-1)  # [n, V]
        loss = F.nll_loss(logprobs, ids[:, 1:][mask])
        top_ids, top_probs, has = teacher_targets(seqs, length, self.cfg.target_topk)
        has = has[mask]  # [n]: rows are at output positions only
        if self.cfg.target_topk and has.any():  # [m, k]: the draft's logprobs of the top-k
            picked = logprobs[has].gather(-1, top_ids[mask][has])
            loss = loss - (top_probs[mask][has] * picked).sum(-1).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.optimizer.step()
        self.num_steps += 1
        spent = time.perf_counter() - start
        self.busy_s += spent
        time.sleep(spent * (1 / self.cfg.max_duty - 1))  # the serving path's share

    def _window(self, s: Served) -> Served:
        """A window of at most cfg.window positions ending in output tokens."""
        if len(s.token_ids) <= self.cfg.window:
            return s
        end = self.rng.randrange(max(self.cfg.window, s.prompt_len + 2), len(s.token_ids) + 1)
        return s.cropped(end - self.cfg.window, end)
