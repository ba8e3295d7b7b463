"""Exact speculative verification (rejection sampling), batched, a different γ per row.

Draft token x at a position is accepted with probability min(1, p(x) / q(x)); at the first
rejection the *recovered* token is drawn from norm(max(0, p - q)); when every draft token
is accepted the *bonus* token is drawn from p at the extra position. Greedy requests
arrive as point masses (p = one-hot argmax, q = one-hot draft), which makes the same
arithmetic accept exactly the draft tokens equal to the target argmax.

A point-mass draft (q(x) = 1: lookups, lookahead) is verified as a greedy one is, against
the token the target samples there itself, with the position's own sample uniform: kept
when they are equal, else the target's token is emitted. That keeps x with probability
p(x), as the rule above does, and emits exactly what the target alone would with the
request's seed, whatever proposed x; so a proposer may draw its guesses with those same
uniforms (lookahead does: where a guess's distribution is the target's, it is the token).

q formats (docs/DESIGN.md §3) only differ on the wire; `dense_draft_probs` turns each into the
dense q rows used here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from outrider.engine.sampling import sample_from_probs
from outrider.engine.tree import children_of


@dataclass
class RejectionResult:
    token_ids: torch.Tensor     # [batch, max_gamma + 1] emitted tokens, -1 after the last one
    num_accepted: torch.Tensor  # [batch] accepted draft tokens (0..γ_i)

    @property
    def num_emitted(self) -> torch.Tensor:  # [batch] accepted + one recovered or bonus token
        return self.num_accepted + 1


def rejection_sample(
    target_probs: torch.Tensor,     # [batch, max_gamma + 1, vocab]; row γ_i is the bonus row
    draft_token_ids: torch.Tensor,  # [batch, max_gamma] int64, any value in padding
    draft_probs: torch.Tensor,      # [batch, max_gamma, vocab] q after processing
    num_draft: torch.Tensor,        # [batch] γ_i
    accept_uniforms: torch.Tensor,  # [batch, max_gamma] in [0, 1)
    sample_uniforms: torch.Tensor,  # [batch, max_gamma + 1] in [0, 1), indexed by emit row
) -> RejectionResult:
    batch, max_gamma = draft_token_ids.shape
    device = target_probs.device
    vocab = target_probs.shape[-1]
    ids = draft_token_ids.clamp(0, vocab - 1).unsqueeze(-1)  # [batch, max_gamma, 1]
    p_draft = target_probs[:, :max_gamma].gather(-1, ids).squeeze(-1)  # [batch, max_gamma]
    q_draft = draft_probs.gather(-1, ids).squeeze(-1)
    sample_uniforms = sample_uniforms.to(device)
    is_in_draft = torch.arange(max_gamma, device=device) < num_draft[:, None]
    is_point = (q_draft >= 1.0) & is_in_draft  # [batch, max_gamma]
    own = torch.full_like(draft_token_ids, -1)  # the target's own sample at point masses
    own[is_point] = sample_from_probs(target_probs[:, :max_gamma][is_point],
                                      sample_uniforms[:, :max_gamma][is_point])
    # u < p/q without dividing: q(x) > 0 for every sampled x
    is_accepted = torch.where(is_point, own == draft_token_ids,
                              accept_uniforms.to(device) * q_draft < p_draft) & is_in_draft
    num_accepted = is_accepted.long().cumprod(-1).sum(-1)  # [batch]

    rows = torch.arange(batch, device=device)
    p_final = target_probs[rows, num_accepted]  # [batch, vocab]
    is_bonus = num_accepted == num_draft
    if not max_gamma:
        return _emit(draft_token_ids, num_accepted,
                     sample_from_probs(p_final, sample_uniforms[rows, num_accepted]))
    last = num_accepted.clamp(max=max_gamma - 1)
    residual = (p_final - draft_probs[rows, last]).clamp(min=0)
    # a rejection implies p(x) < q(x), so the residual has mass; guard rounding anyway
    is_degenerate = residual.sum(-1) <= 0
    residual = torch.where((is_bonus | is_degenerate)[:, None], p_final, residual)
    final = sample_from_probs(residual, sample_uniforms[rows, num_accepted])
    final = torch.where(is_point[rows, last] & ~is_bonus, own[rows, last], final)
    return _emit(draft_token_ids, num_accepted, final)


def greedy_verify(
    target_argmax: torch.Tensor,    # [batch, max_gamma + 1] target argmax per verified row
    draft_token_ids: torch.Tensor,  # [batch, max_gamma]
    num_draft: torch.Tensor,        # [batch] γ_i
) -> RejectionResult:
    """The all-greedy batch: what `rejection_sample` computes for point masses, without
    building distributions — accept while draft == argmax, then emit the argmax."""
    max_gamma = draft_token_ids.shape[1]
    is_in_draft = torch.arange(max_gamma, device=num_draft.device) < num_draft[:, None]
    is_accepted = (draft_token_ids == target_argmax[:, :max_gamma]) & is_in_draft
    num_accepted = is_accepted.long().cumprod(-1).sum(-1)  # [batch]
    rows = torch.arange(len(num_accepted), device=num_accepted.device)
    return _emit(draft_token_ids, num_accepted, target_argmax[rows, num_accepted])


def _emit(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
          final: torch.Tensor) -> RejectionResult:
    """[batch, max_gamma + 1]: the accepted drafts, then the final token, then -1."""
    batch, max_gamma = draft_token_ids.shape
    positions = torch.arange(max_gamma + 1, device=draft_token_ids.device)
    padded = torch.nn.functional.pad(draft_token_ids, (0, 1))
    token_ids = torch.where(positions < num_accepted[:, None], padded, -1)
    token_ids[torch.arange(batch, device=final.device), num_accepted] = final
    return RejectionResult(token_ids=token_ids, num_accepted=num_accepted)


def dense_draft_probs(draft_token_ids: torch.Tensor, vocab: int,
                      sparse_ids: torch.Tensor | None = None,
                      sparse_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Dense q [batch, max_gamma, vocab] from the compact wire formats.

    ids only / point mass: one-hot at each draft token (sparse_* None).
    sparse: sparse_ids, sparse_probs [batch, max_gamma, support] (pad probs with 0)."""
    shape = (*draft_token_ids.shape, vocab)
    q = torch.zeros(shape, dtype=torch.float32, device=draft_token_ids.device)
    if sparse_ids is None:
        return q.scatter_(-1, draft_token_ids.clamp(0, vocab - 1).unsqueeze(-1), 1.0)
    return q.scatter_add_(-1, sparse_ids.long(), sparse_probs.float())


def tree_rejection_sample(
    parents: list[int],            # [n] each node's parent (-1: the committed tokens)
    tokens: list[int],             # [n] each node's token
    target_probs: torch.Tensor,    # [n + 1, vocab] p at the committed tokens', then each node's row
    draft_probs: torch.Tensor,     # [n, vocab] the q each node was drawn from (its parent's)
    accept_uniforms: torch.Tensor,  # [depth + 1, children] in [0, 1): per depth, per sibling
    sample_uniforms: torch.Tensor,  # [depth + 1] in [0, 1)
) -> tuple[list[int], int]:
    """Recursive rejection sampling down a token tree whose siblings are draws without
    replacement from their parent's q (engine/tree.py). At a node, its children are
    tested in the order drawn: child x is accepted with probability min(1, p(x)/q(x));
    on a rejection p becomes norm(max(p - q, 0)) and q loses x (renormalised), and the
    next child is tested; when none is accepted the token is drawn from what p has
    become, and the walk ends there (at a leaf: from p itself, the bonus token). Returns
    (the accepted nodes, root first; the final token). The committed tokens follow the
    target's distribution exactly."""
    children = children_of(parents)
    # numpy rows: a row's walk is a few small steps each, where torch's per-call cost
    # made the walk 3x slower
    target, draft = target_probs.double().cpu().numpy(), draft_probs.double().cpu().numpy()
    accept = accept_uniforms.double().cpu().numpy()
    path, node = [], -1
    while True:
        depth = len(path)
        p = target[node + 1]
        kids = children.get(node, [])
        q = draft[kids[0]].copy() if kids else None
        accepted = None
        for j, child in enumerate(kids):
            x = tokens[child]
            if accept[depth, j] * q[x] < p[x]:
                accepted = child
                break
            residual = np.maximum(p - q, 0.0)
            mass = residual.sum()
            p = residual / mass if mass > 0 else p
            q[x] = 0.0
            if q.sum() <= 0:
                break
            q /= q.sum()
        if accepted is None:
            final = sample_from_probs(torch.from_numpy(p)[None], sample_uniforms[depth:depth + 1])
            return path, int(final[0])
        path.append(accepted)
        node = accepted
