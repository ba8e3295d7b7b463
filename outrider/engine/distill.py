"""Online distillation of a draft model on the traffic it drafts for (docs/DESIGN.md §8.6).

Every sequence a draft replica serves ends with its committed tokens: the target's own
output, verified. They are the training data: cross-entropy of the draft on the target's
output tokens, given everything before them (the prompt conditions, it is not learned).
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

import torch
import torch.nn.functional as F

from outrider.engine.model import CausalLM
from outrider.engine.rope import apply_rope
from outrider.engine.runner import ModelRunner


@dataclass(frozen=True)
class DistillConfig:
    buffer_tokens: int = 200_000   # recent traffic kept (the oldest sequences go first)
    round_tokens: int = 4_000      # new output tokens that start a training round
    steps_per_round: int = 20
    batch: int = 8                 # windows per step
    window: int = 256              # positions per window
    lr: float = 1e-4
    holdout_every: int = 5         # every 5th sequence is held out, never trained on
    heldout_eval: int = 32         # the most recent held-out sequences a round checks on
    max_duty: float = 0.3          # at most this share of wall time spent training

    def __post_init__(self) -> None:
        if not 0 < self.max_duty <= 1:
            raise ValueError(f"max_duty must be in (0, 1], got {self.max_duty}")
        if min(self.buffer_tokens, self.round_tokens, self.steps_per_round, self.batch,
               self.window, self.holdout_every, self.heldout_eval) < 1 or self.lr <= 0:
            raise ValueError("distillation sizes and lr must be positive")


@dataclass(frozen=True)
class Served:
    """One finished sequence: its tokens and where the prompt ends."""

    token_ids: tuple[int, ...]
    prompt_len: int

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

    def add(self, token_ids: list[int], prompt_len: int) -> None:
        if len(token_ids) - prompt_len < 2:
            return  # nothing to learn from
        served = Served(tuple(token_ids[-self.cfg.window * 4:]),
                        max(0, prompt_len - max(0, len(token_ids) - self.cfg.window * 4)))
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


def causal_logits(model: CausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, T] -> logits [batch, T, vocab]: one causal pass with no KV cache, through
    the same modules the engine serves with (differentiable when their weights are)."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).repeat(batch)
    x = model.embed_tokens(input_ids.reshape(-1))  # [batch * T, hidden]
    cos_sin = model.rope.lookup(positions, x.dtype)
    for layer in model.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos_sin, batch, length)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x)).view(batch, length, -1)


def _attention(attn, x: torch.Tensor, cos_sin, batch: int, length: int) -> torch.Tensor:
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(x).view(-1, heads + 2 * kv_heads, dim)
    qk = apply_rope(qkv[:, :heads + kv_heads], cos_sin)
    split = lambda t: t.reshape(batch, length, -1, dim).transpose(1, 2)  # noqa: E731
    q, k, v = split(qk[:, :heads]), split(qk[:, heads:]), split(qkv[:, heads + kv_heads:])
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # [b, H, T, D]
    mask = None
    if attn.window:
        pos = torch.arange(length, device=x.device)
        mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < attn.window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(batch * length, heads * dim))


def trainable_copy(runner: ModelRunner) -> CausalLM:
    """The runner's model as loaded from its checkpoint, in a form that trains: plain
    (not prepacked) linears, gradients on every parameter."""
    model = runner.build_model()
    for p in model.parameters():
        p.requires_grad_(True)
    return model.train()


def output_mask(seqs: list[Served], length: int) -> torch.Tensor:
    """[batch, length - 1] True where position t + 1 is an output token (the target's)."""
    mask = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    for i, s in enumerate(seqs):
        mask[i, max(0, s.prompt_len - 1):len(s.token_ids) - 1] = True
    return mask


def _padded(seqs: list[Served], length: int) -> torch.Tensor:
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s.token_ids)] = torch.tensor(s.token_ids[:length])
    return ids


@torch.no_grad()
def agreement(model: CausalLM, seqs: list[Served]) -> float:
    """Teacher-forced top-1 agreement with the target's output tokens: how often greedy
    drafting would propose exactly the token the target produced."""
    hits = total = 0
    for s in seqs:
        ids = _padded([s], len(s.token_ids))
        predicted = causal_logits(model, ids)[:, :-1].argmax(-1)  # [1, T - 1]
        mask = output_mask([s], len(s.token_ids))
        hits += int((predicted[mask] == ids[:, 1:][mask]).sum())
        total += int(mask.sum())
    return hits / total if total else 0.0


class Distiller:
    """A training copy of the draft; `train_round` returns the copy's weights when they
    beat `serving`'s on the held-out traffic, else None (the serving draft stays)."""

    def __init__(self, runner: ModelRunner, cfg: DistillConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.student = trainable_copy(runner)
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=cfg.lr,
                                           weight_decay=0.0)
        self.rng = random.Random(seed)
        self.num_steps = 0
        self.busy_s = 0.0

    def train_round(self, buffer: TrafficBuffer, serving: CausalLM) -> tuple[dict | None, float,
                                                                             float]:
        """Some steps on the buffer, then the held-out check. Returns (the student's
        weights if better, the serving agreement, the student's agreement)."""
        buffer.new_output_tokens = 0
        for _ in range(self.cfg.steps_per_round):
            self._step(list(buffer.train))
        heldout = list(buffer.heldout)[-self.cfg.heldout_eval:]
        old, new = agreement(serving, heldout), agreement(self.student.eval(), heldout)
        self.student.train()
        better = {k: v.detach().clone() for k, v in self.student.state_dict().items()}
        return (better if new > old else None), old, new

    def _step(self, pool: list[Served]) -> None:
        if not pool:
            return
        start = time.perf_counter()
        seqs = [self._window(self.rng.choice(pool)) for _ in range(self.cfg.batch)]
        length = max(len(s.token_ids) for s in seqs)
        ids = _padded(seqs, length)
        logits = causal_logits(self.student, ids)[:, :-1]  # [b, T - 1, V]
        mask = output_mask(seqs, length)
        loss = F.cross_entropy(logits[mask], ids[:, 1:][mask])
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
        start = end - self.cfg.window
        return Served(s.token_ids[start:end], max(0, s.prompt_len - start))
