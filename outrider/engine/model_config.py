"""Model configuration read from a Hugging Face `config.json`.

One frozen dataclass covers the Llama family (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2
and 3, and with routed experts Mixtral and Qwen3-MoE): they differ in QKV bias, per-head
query and key norms, sliding-window attention, how much of a head RoPE rotates and its
scaling, Gemma's norms, scales and caps, and the experts, which are fields here (Phi-3's
fused projections are a matter of loading: model.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from outrider.core.hf_config import ModelConfigError, context_length, read_config
from outrider.engine.quant.scheme import (
    ON_LOAD,
    QuantizationError,
    QuantScheme,
    parse_quantization,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                           "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_TP = (1, 2, 4, 8)

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling: Llama-3's (`rope_type: llama3`) or LongRoPE's (`longrope`, Phi-3's
    long-context checkpoints: a factor per frequency, the short ones for positions within
    the original context and the long ones past it, cos and sin scaled by
    attention_factor)."""

    original_max_position_embeddings: int
    rope_type: str = "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False       # Qwen3: each head's query and key RMS-normed before RoPE
    partial_rotary_factor: float = 1.0  # the share of head_dim RoPE rotates (Phi-4-mini 0.75)
    # mixture of experts (Mixtral, Qwen3-MoE; moe.py): per layer whether its MLP is the
    # routed experts' (empty: none is)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to one
    hidden_act: str = "silu"    # the MLP gate's (Gemma's: GELU, tanh approximation)
    # Gemma: norms scale by (1 + w), the embedding by sqrt(hidden), each block's output is
    # normed too (sandwich), queries scale by query_pre_attn_scalar, Gemma 3's
    # sliding-window layers rotate with their own base
    norm_offset: float = 0.0
    embedding_multiplier: float = 1.0
    sandwich_norms: bool = False
    query_scale: float | None = None  # None: head_dim ** -0.5
    local_rope_theta: float | None = None  # sliding-window layers' RoPE base (no scaling)
    attn_logit_softcap: float = 0.0   # Gemma 2: scores capped by c * tanh(score / c)
    final_logit_softcap: float = 0.0  # and the logits likewise
    rope_scaling: RopeScaling | None = None
    # per layer: window in tokens, or None for full attention
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization: QuantScheme | None = None  # a quantized checkpoint's (quant/scheme.py)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config.json: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ModelConfigError(f"config.json: RoPE's dimensions ({self.rotary_dim} of "
                                   f"head_dim {self.head_dim}) must be even")
        if len(self.sliding_windows) != self.num_layers:
            raise ModelConfigError("config.json: layer_types does not match num_hidden_layers")

    @property
    def rotary_dim(self) -> int:
        """The first dimensions of each head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def check_tp(self, tp: int) -> None:
        """Raise a clear error when `tp` cannot shard this model."""
        if tp not in SUPPORTED_TP:
            raise ModelConfigError(f"tp={tp} is not supported; choose one of {SUPPORTED_TP}")
        for what, count in (("num_attention_heads", self.num_heads),
                            ("num_key_value_heads", self.num_kv_heads)):
            if count % tp:
                raise ModelConfigError(f"tp={tp} does not divide {what} ({count})")
        if self.intermediate_size % tp:
            raise ModelConfigError(
                f"tp={tp} does not divide intermediate_size ({self.intermediate_size})")
        if any(self.moe_layers) and self.moe_intermediate_size % tp:
            raise ModelConfigError(f"tp={tp} does not divide the experts' intermediate size "
                                   f"({self.moe_intermediate_size})")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        experts = self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size
                                      + self.hidden_size)
        mlps = sum(experts if is_moe else mlp for is_moe in self.moe_layers or
                   (False,) * self.num_layers)
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return (self.num_layers * (attn + 2 * self.hidden_size) + mlps + embed
                + self.hidden_size)

    @classmethod
    def from_dir(cls, model_dir: str | Path, quantize_on_load: str | None = None
                 ) -> ModelConfig:
        """`quantize_on_load`: vLLM's --quantization, which quantizes an unquantized
        checkpoint as it loads (a quantized one's own config decides)."""
        raw = read_config(model_dir)
        generation = read_config(model_dir, "generation_config.json", required=False)
        return cls.from_hf_dict(raw, generation, source=str(Path(model_dir) / "config.json"),
                                quantize_on_load=quantize_on_load)

    @classmethod
    def from_hf_dict(cls, raw: dict, generation: dict | None = None,
                     source: str = "config.json", quantize_on_load: str | None = None
                     ) -> ModelConfig:
        arch = (raw.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        quantization = _quantization(raw, arch, source, quantize_on_load)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only "
                                   f"{', '.join(ACTIVATIONS)})")
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // heads)
            num_layers = int(raw["num_hidden_layers"])
            rope = _rope_parameters(raw)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                local_rope_theta=_local_rope_theta(raw, arch),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=context_length(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in GEMMA)),
                dtype=_parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32", source),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                hidden_act=act,
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
                partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                     raw.get("partial_rotary_factor", 1.0))),
                rope_scaling=_parse_rope_scaling(rope, raw, source),
                sliding_windows=_sliding_windows(raw, arch, num_layers),
                eos_token_ids=_eos_token_ids(raw, generation or {}, source),
                bos_token_id=raw.get("bos_token_id"),
                quantization=quantization,
                **_moe(raw, arch, num_layers),
                **_gemma(raw, arch, hidden, head_dim),
            )
        except KeyError as exc:
            raise ModelConfigError(f"{source}: missing required key {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"{source}: bad value ({exc})") from exc


def _rope_parameters(raw: dict) -> dict:
    # transformers >= 5 writes `rope_parameters` (Gemma 3: one per layer type, the global
    # layers' here); older checkpoints use `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    return dict(rope.get("full_attention", rope))


def _local_rope_theta(raw: dict, arch: str) -> float | None:
    """Gemma 3's sliding-window layers' RoPE base: their own rope_parameters, or
    rope_local_base_freq in older configs."""
    if arch != "Gemma3ForCausalLM":
        return None
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    return float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0)


def _gemma(raw: dict, arch: str, hidden: int, head_dim: int) -> dict:
    if arch not in GEMMA:
        return {}
    return dict(norm_offset=1.0, embedding_multiplier=hidden ** 0.5, sandwich_norms=True,
                query_scale=float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                attn_logit_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
                final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0))


def _parse_rope_scaling(rope: dict, raw: dict, source: str) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":  # Gemma 3's global layers: positions divided by the factor
        return RopeScaling(0, "linear", float(rope["factor"]))
    # Phi-3 keeps the pretrained context beside max_position_embeddings, not in the rope dict
    original = int(rope.get("original_max_position_embeddings")
                   or raw["original_max_position_embeddings"])
    if kind == "llama3":
        return RopeScaling(original, "llama3", float(rope["factor"]),
                           float(rope["low_freq_factor"]), float(rope["high_freq_factor"]))
    if kind in ("longrope", "su"):  # "su": the name older Phi-3 configs use
        factor = float(rope.get("factor") or raw["max_position_embeddings"] / original)
        attention = rope.get("attention_factor")
        if attention is None:  # the LongRoPE paper's, as transformers and vLLM take it
            attention = (math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1
                         else 1.0)
        return RopeScaling(original, "longrope", factor,
                           short_factor=tuple(map(float, rope["short_factor"])),
                           long_factor=tuple(map(float, rope["long_factor"])),
                           attention_factor=float(attention))
    raise ModelConfigError(f"{source}: rope_scaling type {kind!r} is not supported "
                           "(supported: default, linear, llama3, longrope)")


def _moe(raw: dict, arch: str, num_layers: int) -> dict:
    """The routed experts' fields: Mixtral's in every layer; Qwen3-MoE's where
    decoder_sparse_step says and mlp_only_layers does not."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = int(raw.get("num_local_experts") or raw["num_experts"])
    if arch == "MixtralForCausalLM":
        layers, size, norm = (True,) * num_layers, int(raw["intermediate_size"]), True
    else:
        step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers", []))
        layers = tuple(i not in dense and step > 0 and (i + 1) % step == 0
                       for i in range(num_layers))
        size, norm = int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False))
    return dict(moe_layers=layers, num_experts=experts, moe_intermediate_size=size,
                num_experts_per_tok=int(raw["num_experts_per_tok"]), norm_topk_prob=norm)


def _sliding_windows(raw: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return (int(window) if window else None,) * num_layers
    if arch in GEMMA and window:  # every pattern-th layer global, the others windowed
        pattern = int(raw.get("sliding_window_pattern")
                      or (2 if arch == "Gemma2ForCausalLM" else 6))
        types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") \
            and raw.get("use_sliding_window") and window:
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= int(raw.get("max_window_layers", num_layers))
            else "full_attention" for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (None,) * num_layers


def _parse_dtype(name: str, source: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ModelConfigError(f"{source}: torch_dtype {name!r} is not supported "
                               "(float32, bfloat16, float16)")
    return _DTYPES[name]


def parse_dtype(name: str) -> torch.dtype:
    return _parse_dtype(name, "dtype")


def _eos_token_ids(raw: dict, generation: dict, source: str) -> tuple[int, ...]:
    """Every id config.json and generation_config.json name as EOS (either may list
    several; both end a sequence, as in vLLM). One outside the vocabulary can never be
    generated: it is dropped with a warning, as transformers only warns of it."""
    named = {*_token_ids(raw.get("eos_token_id")), *_token_ids(generation.get("eos_token_id"))}
    vocab = int(raw["vocab_size"])
    outside = sorted(t for t in named if not 0 <= t < vocab)
    if outside:
        log.warning("%s: eos_token_id %s outside the vocabulary (%d tokens) ignored: EOS "
                    "never comes from it", source, ", ".join(map(str, outside)), vocab)
    return tuple(sorted(named - set(outside)))


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _quantization(raw: dict, arch: str, source: str,
                  on_load: str | None) -> QuantScheme | None:
    """A quantized checkpoint's scheme, refused at start where it cannot be served; an
    unquantized one's, quantized as it loads, where `on_load` names a method that does."""
    if raw.get("quantization_config"):
        try:
            scheme = parse_quantization(raw["quantization_config"])
        except QuantizationError as exc:
            raise ModelConfigError(f"{source}: a quantized checkpoint that cannot be served: "
                                   f"{exc}") from exc
    elif on_load is None:
        return None
    elif on_load not in ON_LOAD:
        raise ModelConfigError(f"{source}: --quantization {on_load} needs a checkpoint "
                               f"quantized with it; an unquantized one is quantized as it "
                               f"loads by {', '.join(ON_LOAD)} only")
    else:
        scheme = ON_LOAD[on_load]
    if arch in MOE_ARCHITECTURES:
        raise ModelConfigError(f"{source}: a quantized checkpoint ({scheme.description}) of "
                               f"routed experts ({arch}) cannot be served yet")
    return scheme
