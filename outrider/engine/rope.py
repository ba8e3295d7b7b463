"""Rotary position embedding (RoPE), with Llama-3's and LongRoPE's frequency scaling."""

from __future__ import annotations

import math

import torch

from outrider.engine.model_config import ModelConfigError, RopeScaling


def _wavelength_bases(head_dim: int, theta: float) -> torch.Tensor:
    """theta ** (2i / head_dim) for each of the head_dim // 2 frequencies, in fp32 as the
    reference computes them."""
    return theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (LongRoPE's per position: RotaryEmbedding)."""
    inv_freq = 1.0 / _wavelength_bases(head_dim, theta)
    kind = scaling.rope_type if scaling is not None else None
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind != "llama3":
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE's inverse frequencies [head_dim // 2], one factor each."""
    bases = _wavelength_bases(head_dim, theta)
    if len(factors) != len(bases):
        raise ModelConfigError(f"config.json: rope_scaling longrope has {len(factors)} "
                               f"factors for RoPE's {len(bases)} frequencies")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * bases)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to flattened ragged tokens, looking positions up in a cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = positions * inv_freq[None, :]  # [max_positions, head_dim // 2]
        scale = 1.0
        if scaling is not None and scaling.rope_type == "longrope":
            # each position by its own: within the original context the short factors,
            # past it the long ones (what cached keys were rotated with stays true)
            short, long = (positions * _longrope_inv_freq(head_dim, theta, factors)[None, :]
                           for factors in (scaling.short_factor, scaling.long_factor))
            freqs = torch.where(positions < scaling.original_max_position_embeddings,
                                short, long)
            scale = scaling.attention_factor
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin for a forward's positions [num_tokens] -> 2 x [num_tokens, 1, head_dim];
        looked up once per forward and shared by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] (queries and keys stacked on the heads axis)."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
