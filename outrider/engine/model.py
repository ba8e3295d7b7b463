"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and 3, and with
routed experts Mixtral and Qwen3-MoE: moe.py) built from tensor-parallel layers."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from outrider.engine.attention import AttentionMetadata
from outrider.engine.checkpoint import CheckpointError, iter_tensor_slices
from outrider.engine.compiled import attention
from outrider.engine.features import FeatureTap
from outrider.engine.kernels import runs_kernels
from outrider.engine.model_config import ModelConfig
from outrider.engine.moe import SparseMoE, checkpoint_name
from outrider.engine.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    load_replicated,
)
from outrider.engine.quant.formats import quantized_tensor_slices
from outrider.engine.quant.scheme import QuantScheme
from outrider.engine.quant.weight import QuantizedWeight, fp8_on_load
from outrider.engine.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_kernels(x):
            return torch.ops.outrider_cpu.rms_norm(x, self.weight, self.eps, None)
        if x.dtype == torch.float32:  # the fused kernel is bit-identical to the formula below
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 whatever the model dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x); the C++ path adds into `residual`."""
        if runs_kernels(x):
            return torch.ops.outrider_cpu.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup,
                 input_size: int | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.window = cfg.sliding_windows[layer]
        self.scale = cfg.query_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_logit_softcap
        self.qkv_proj = QKVParallelLinear(input_size or cfg.hidden_size, cfg.head_dim,
                                          cfg.num_heads,
                                          cfg.num_kv_heads, cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        False, tp)
        # Qwen3, Gemma 3: over head_dim, shared by every head (so replicated across ranks)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin: tuple, kv_cache: tuple,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [num_tokens, hidden]
        q, k, v = self.queries_keys_values(x, cos_sin)
        out = attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.window, self.scale,
                        self.softcap)
        return self.o_proj(out)

    def queries_keys_values(self, x: torch.Tensor, cos_sin: tuple) -> tuple[torch.Tensor, ...]:
        """x [num_tokens, hidden] -> q [num_tokens, heads, head_dim], k and v [num_tokens,
        kv_heads, head_dim]: projected, normed (Qwen3, Gemma 3) and rotated (the first
        rotary_dim dimensions of each head: Phi-4-mini rotates 3/4 of them)."""
        heads, kv_heads, rotary = self.num_heads, self.num_kv_heads, self.rotary_dim
        qkv = self.qkv_proj(x).view(-1, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        if runs_kernels(qkv):  # queries and keys rotated in place, in one go
            torch.ops.outrider_cpu.rope_(qkv[:, :heads + kv_heads, :rotary], *cos_sin)
            qk = qkv
        elif rotary == self.head_dim:
            qk = apply_rope(qkv[:, :heads + kv_heads], cos_sin)
        else:
            qk = torch.cat([apply_rope(qkv[:, :heads + kv_heads, :rotary], cos_sin),
                            qkv[:, :heads + kv_heads, rotary:]], dim=-1)
        return qk[:, :heads], qk[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [num_tokens, heads + 2 kv_heads, head_dim] with every query and key head
        RMS-normed (a new tensor: the rotation then runs in place on it)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :heads].reshape(-1, dim)).view(-1, heads, dim)
        k = self.k_norm(qkv[:, heads:heads + kv_heads].reshape(-1, dim)).view(-1, kv_heads, dim)
        return torch.cat([q, k, qkv[:, heads + kv_heads:]], dim=1)


class MLP(nn.Module):
    """The gated MLP (a layer's, or one routed expert's of `intermediate` features)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate: int | None = None) -> None:
        super().__init__()
        size = intermediate or cfg.intermediate_size
        self.is_gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's; else SiLU
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size] * 2,
                                                       cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activated(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce and any bias (routed
        experts sum theirs first: moe.py)."""
        return self.down_proj.matmul(self._activated(x))

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if runs_kernels(gate_up) and not self.is_gelu:
            return torch.ops.outrider_cpu.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.is_gelu:
            return nn.functional.gelu(gate, approximate="tanh") * up
        return nn.functional.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup,
                 input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        is_moe = bool(cfg.moe_layers) and cfg.moe_layers[layer]
        self.mlp = SparseMoE(cfg, tp, MLP) if is_moe else MLP(cfg, tp)
        # (EAGLE-1 heads have none: their input is already a fused feature)
        self.input_layernorm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm
                                else nn.Identity())
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma's sandwich: post_attention_layernorm norms the attention's output, these the
        # MLP's input and output
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.pre_feedforward_layernorm = norm
        self.post_feedforward_layernorm = copy.deepcopy(norm)

    def forward(self, x, cos_sin, kv_cache, meta) -> torch.Tensor:
        # x: [num_tokens, hidden], this layer's own (the previous layer's fresh output)
        return self.around(x, lambda h: self.self_attn(h, cos_sin, kv_cache, meta))

    def around(self, x: torch.Tensor,
               attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's norms, residuals and MLP around `attend`, the attention of its
        normed input (the engine's over the paged cache; distillation's over whole
        sequences, distill.py)."""
        attended = attend(self.input_layernorm(x))
        if self.pre_feedforward_layernorm is not None:
            attended = self.post_attention_layernorm(attended)
            h, x = self.pre_feedforward_layernorm.add_and_norm(attended, x)
            return x + self.post_feedforward_layernorm(self.mlp(h))
        h, x = self.post_attention_layernorm.add_and_norm(attended, x)
        return x + self.mlp(h)


class CausalLM(nn.Module):
    """Decoder-only LM over flattened ragged tokens; logits only for the rows asked for."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta,
                                    cfg.rope_scaling)
        # Gemma 3's sliding-window layers rotate with a base of their own
        self.local_rope = (RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.local_rope_theta,
                                           None) if cfg.local_rope_theta else None)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.tap: FeatureTap | None = None  # the hidden states a draft head reads
        self.features: torch.Tensor | None = None  # [num_tokens, tap width], last forward's

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens]; logits_rows: [num_rows] -> [num_rows, vocab]
        x = self.embed(input_ids)
        rotations = self.rotations(positions, x.dtype)
        taps = []
        for i, (layer, cos_sin, kv_cache) in enumerate(zip(self.layers, rotations, kv_caches,
                                                          strict=True)):
            if self.tap is not None and i in self.tap.layers:
                taps.append(x.clone())  # (the next layer adds into x in place)
            x = layer(x, cos_sin, kv_cache, meta)
        if self.tap is None:
            return self.logits(self.norm(x.index_select(0, logits_rows)))
        if self.tap.normed:
            normed = self.norm(x)  # [num_tokens, hidden]
            self.features = normed
            return self.logits(normed.index_select(0, logits_rows))
        self.features = self.tap.keep(
            torch.cat(taps + [x] * (self.cfg.num_layers in self.tap.layers), -1))
        return self.logits(self.norm(x.index_select(0, logits_rows)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden] (Gemma's scaled, in the model's dtype as
        its own)."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.cfg.embedding_multiplier, dtype=x.dtype)
        return x

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        """Each layer's cos/sin for `positions`, looked up once per table (Gemma 3's
        sliding-window layers have one of their own)."""
        cos_sin = self.rope.lookup(positions, dtype)
        local = self.local_rope.lookup(positions, dtype) if self.local_rope else cos_sin
        return [local if layer.self_attn.window else cos_sin for layer in self.layers]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] normed -> fp32 logits [rows, vocab] (Gemma 2's soft-capped)."""
        logits = self.lm_head(normed).float()
        cap = self.cfg.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, model_dir: Path) -> None:
        tied = self.cfg.tie_word_embeddings
        load_checkpoint(self, model_dir, self._param_for,
                        optional=lambda name: tied and name == "lm_head.weight",
                        quantization=self.cfg.quantization)
        if self.cfg.norm_offset:  # Gemma's norms scale by (1 + w): kept as the factor
            with torch.no_grad():
                for norm in self.modules():
                    if isinstance(norm, RMSNorm):
                        norm.weight.add_(self.cfg.norm_offset)

    def _param_for(self, name: str) -> tuple[str, int | None] | None:
        # a multimodal checkpoint's language model (hf_config.text_model): its own names,
        # under language_model. (or model.language_model.); the rest is not loaded
        name = name.removeprefix("model.").removeprefix("language_model.")
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        return fused_param(checkpoint_name(name.removeprefix("model.")))


# checkpoint name fragment -> (our fused parameter, shard index)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


def fused_param(name: str) -> tuple[str, int | None]:
    """A checkpoint tensor's (parameter, shard index) in our fused layers."""
    for part, (fused, shard_id) in FUSED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def load_checkpoint(model: nn.Module, model_dir: Path,
                    param_for: Callable[[str], tuple[str, int | None] | None],
                    optional: Callable[[str], bool] = lambda name: False,
                    quantization: QuantScheme | None = None) -> None:
    """Every tensor of the checkpoint into its parameter (`param_for`: None skips one);
    each parameter but the `optional` ones must be found. A quantized checkpoint's modules
    arrive as one weight each (quant/formats.py), or an unquantized one's linears are
    quantized as they arrive (`quantization.on_load`): a linear keeps it until the
    checkpoint is read (settle_quantized), any other layer (an embedding, a head) takes it
    dequantized."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tensors = iter_tensor_slices(model_dir)
    on_load = quantization is not None and quantization.on_load
    if quantization is not None and not on_load:
        tensors = quantized_tensor_slices(model_dir, tensors, quantization)
    for name, tensor_slice in tensors:
        target = param_for(name)
        if target is None:
            continue
        param_name, shard_id = target
        if param_name not in params:
            raise CheckpointError(f"{model_dir}: unexpected tensor {name!r} for "
                                  f"{type(model).__name__}")
        owner, _, _ = param_name.rpartition(".")
        module = model.get_submodule(owner)
        if on_load and isinstance(module, ReplicatedLinear) and param_name.endswith(".weight"):
            tensor_slice = fp8_on_load(tensor_slice[...])  # whole: one scale a tensor
        if isinstance(tensor_slice, QuantizedWeight) and not isinstance(module,
                                                                        ReplicatedLinear):
            tensor_slice = tensor_slice.dequantized(params[param_name].dtype)
        loader = getattr(module, "weight_loader", load_replicated)
        try:
            loader(params[param_name], tensor_slice, shard_id)
        except ValueError as exc:
            raise CheckpointError(f"{model_dir}: tensor {name!r}: {exc}") from exc
        loaded.add(param_name if shard_id is None else f"{param_name}#{shard_id}")
    missing = []
    for name in params:
        if optional(name) or name in loaded:  # (a fused tensor loaded whole: Phi-3's)
            continue
        fused = next((f for f in SHARDS if f".{f}." in name), None)
        wanted = [f"{name}#{i}" for i in range(SHARDS[fused])] if fused else [name]
        missing += [w for w in wanted if w not in loaded]
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks tensors for {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    for name, module in model.named_modules():
        if isinstance(module, ReplicatedLinear):
            try:
                module.settle_quantized()
            except ValueError as exc:
                raise CheckpointError(f"{model_dir}: {name}: {exc}") from exc
