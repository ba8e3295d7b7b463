"""A Hugging Face checkpoint's config.json, read without torch: what the router needs of
the model (its context) and what the engine's ModelConfig is parsed from."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_CONTEXT = 2048  # a config.json without max_position_embeddings


class ModelConfigError(ValueError):
    """A checkpoint directory or its config.json cannot be used."""


def read_config(model_dir: str | Path, name: str = "config.json",
                required: bool = True) -> dict | None:
    """The JSON file `name` of a checkpoint dir (None when optional and absent); a
    config.json as the language model it describes (text_model)."""
    path = Path(model_dir) / name
    if not path.is_file():
        if not required:
            return None
        raise ModelConfigError(f"{model_dir}: no {name} (not a Hugging Face checkpoint dir)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
    return text_model(raw) if name == "config.json" and isinstance(raw, dict) else raw


def checkpoint_name(model_dir: str | Path) -> str:
    """A checkpoint dir's name as replicas name their model pair and routers match it: the
    name as given (a symlink's, alike on every machine), resolved only where the path has
    none ("." or "..")."""
    name = Path(model_dir).name
    return name if name not in ("", "..") else Path(model_dir).resolve().name


# multimodal checkpoints whose language model is served alone (the vision tower is not
# loaded: model.py skips its tensors), and that model's architecture
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Gemma 3's text defaults (transformers' Gemma3TextConfig): its checkpoints' text_config
# lists only what differs from them
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True, "bos_token_id": 2,
    "eos_token_id": 1}


def text_model(raw: dict) -> dict:
    """A config.json's language model: a multimodal checkpoint's text_config (with the
    outer dtype and token ids where it has none) as its own architecture; Gemma 3's
    defaults filled in."""
    arch = (raw.get("architectures") or [None])[0]
    if arch in TEXT_MODELS:
        outer = {k: raw[k] for k in ("dtype", "torch_dtype", "tie_word_embeddings",
                                     "eos_token_id", "bos_token_id") if k in raw}
        raw = {**outer, **(raw.get("text_config") or {}), "architectures": [TEXT_MODELS[arch]]}
        arch = TEXT_MODELS[arch]
    if arch == "Gemma3ForCausalLM":
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
    return raw


# a draft head's config.json architectures -> its kind (the names vLLM's registry takes
# for Llama-family targets; Qwen2 and Mistral targets use the same layouts; the Medusa
# authors' configs name none, and medusa_num_heads tells them)
HEAD_KINDS = {
    "LlamaForCausalLMEagle3": "eagle3",
    "Eagle3LlamaForCausalLM": "eagle3",
    "EagleLlamaForCausalLM": "eagle1",
    "MedusaModel": "medusa",
}


def head_kind(model_dir: str | Path) -> str | None:
    """'eagle3', 'eagle1' or 'medusa' when `model_dir` holds a draft head that reads the
    target's hidden states, else None (a draft model, or no config.json)."""
    raw = read_config(model_dir, required=False) or {}
    architectures = raw.get("architectures") or [None]
    if not isinstance(architectures, list):
        return None
    if "medusa_num_heads" in raw:  # the Medusa authors' config names no architecture
        return "medusa"
    return HEAD_KINDS.get(architectures[0])


def context_length(raw: dict) -> int:
    return int(raw.get("max_position_embeddings", DEFAULT_CONTEXT))


# what a request leaves unset takes the checkpoint's generation_config.json value, as
# vLLM's --generation-config auto does (the same fields)
SAMPLING_DEFAULT_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                           "repetition_penalty": float}


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling defaults of a checkpoint's generation_config.json (none: {})."""
    raw = read_config(model_dir, "generation_config.json", required=False) or {}
    try:
        return {name: kind(raw[name]) for name, kind in SAMPLING_DEFAULT_FIELDS.items()
                if raw.get(name) is not None}
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"{model_dir}/generation_config.json: {exc}") from None
