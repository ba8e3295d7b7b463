"""Per-request sampling: parameters, logits processing, and position-keyed randomness.

Every distribution the engine samples from or verifies against is produced by
`logits_to_probs`, for draft and target alike (DESIGN §3: p and q are the distributions
after temperature, top-k and top-p). Greedy is the point mass on the argmax, so greedy
and sampled requests share one verification path.

Randomness is a pure function of (seed, absolute position, purpose): output does not
depend on batch composition, on how many tokens a round accepted, or on which replica
ran the round, so a request can be resumed elsewhere and reproduce the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MAX_SEED = 2**63 - 1
GREEDY_BELOW = 1e-5  # temperatures this small are greedy: logits / T would overflow


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no top-k truncation
    top_p: float = 1.0        # 1 = no nucleus truncation
    seed: int | None = None   # None: the engine draws one per request
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, "
                                f"got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise SamplingError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def logits_to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [num_rows, vocab] fp32, one SamplingParams per row -> probs [num_rows, vocab]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [num_rows]
    is_greedy = temperature < GREEDY_BELOW
    probs = torch.zeros_like(logits)
    if bool(is_greedy.any()):
        greedy_rows = is_greedy.nonzero().squeeze(-1)
        probs[greedy_rows, logits[greedy_rows].argmax(-1)] = 1.0
    if bool(is_greedy.all()):
        return probs
    rows = (~is_greedy).nonzero().squeeze(-1)
    sampled = [params[i] for i in rows.tolist()]
    scaled = logits[rows] / temperature[rows, None]
    if any(p.top_k or p.top_p < 1 for p in sampled):
        scaled = _truncate(scaled, sampled)
    probs[rows] = torch.softmax(scaled, dim=-1)
    return probs


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p (nucleus) masking; logits: [num_rows, vocab]."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=logits.device).clamp(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
    kth = sorted_logits.gather(-1, (top_k - 1)[:, None])  # [num_rows, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
    is_outside = mass_before >= top_p[:, None]
    is_outside[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(is_outside, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [num_rows, vocab] (need not be normalised);
    uniforms: [num_rows] in [0, 1). Returns token ids [num_rows]; never a zero-prob token."""
    cdf = probs.double().cumsum(-1)  # [num_rows, vocab]
    targets = (uniforms.double().to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(ids, last_nonzero)


# -- position-keyed randomness -----------------------------------------------------------------

STREAM_DRAFT, STREAM_ACCEPT, STREAM_SAMPLE = 1, 2, 3
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (uint64 arithmetic wraps by definition)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def position_uniforms(seeds: list[int], positions: np.ndarray | list, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) for each (sequence seed, absolute position) and purpose.

    seeds: [batch]; positions: [batch, n] (or [batch]) -> float64 tensor of the same shape."""
    pos = np.asarray(positions, dtype=np.uint64)
    seed = np.asarray(seeds, dtype=np.uint64).reshape((-1,) + (1,) * (pos.ndim - 1))
    with np.errstate(over="ignore"):
        key = _mix64(seed * _GOLDEN + np.uint64(stream))
        bits = _mix64(key + pos * _GOLDEN)
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53)
