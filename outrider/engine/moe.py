"""Routed experts in place of a layer's MLP (Mixtral, Qwen3-MoE).

A router scores every expert for each token; the token goes to its top-k, weighted by
their softmax probabilities (renormalised over the k where the model says so). Each
expert is an MLP like the dense one (its weights prepacked for the CPU alike). Work is
grouped per expert, not per token: the (token, choice) pairs are sorted by expert, and
each expert with tokens multiplies all of them at once, so a verification step of
n(1 + γ) tokens runs at most `num_experts` gathered matmuls per layer, as a decode step
does. Under tensor parallelism every rank holds a slice of every expert's intermediate
features (as the dense MLP is split), and the layer's partial outputs are summed with
one all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from outrider.engine.model_config import ModelConfig
from outrider.engine.parallel import ReplicatedLinear, TPGroup

# Mixtral's checkpoint names -> the ones its experts share with the dense MLP (Qwen3-MoE's)
MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                 ".w2.": ".down_proj."}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, expert: type[nn.Module]) -> None:
        super().__init__()
        self.tp, self.top_k, self.normalise = tp, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, tp)  # router
        self.experts = nn.ModuleList(expert(cfg, tp, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        weights, chosen = self.route(x)                       # [num_tokens, k] each
        order = chosen.flatten().argsort(stable=True)         # the pairs grouped by expert
        tokens = order // self.top_k                          # [num_tokens * k]
        pair_weights = weights.flatten()[order, None]         # [num_tokens * k, 1]
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start:start + count]
                y = expert.partial(x.index_select(0, rows))  # [count, hidden], this rank's
                out.index_add_(0, rows, y * pair_weights[start:start + count])
                start += count
        return self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights (the softmax in fp32, as the
        reference computes it), [num_tokens, k] each."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [num_tokens, experts]
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name with Mixtral's expert names as Qwen3-MoE's."""
    if ".block_sparse_moe." not in name:
        return name
    for theirs, ours in MIXTRAL_NAMES.items():
        name = name.replace(theirs, ours)
    return name
