"""Small random Hugging Face checkpoints, saved with `transformers`, for engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _config(arch: str, **overrides):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )
    from transformers.models.gemma2 import Gemma2Config
    from transformers.models.gemma3 import Gemma3TextConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                # a wide init gives peaked logits, so greedy argmax has no near-ties that
                # fp32 rounding differences between implementations could flip
                initializer_range=0.25, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "mistral": MistralConfig, "phi3": Phi3Config, "mixtral": MixtralConfig,
           "qwen3_moe": Qwen3MoeConfig, "gemma2": Gemma2Config,
           "gemma3": Gemma3TextConfig}[arch]
    return cls(**base)


def save_random_checkpoint(path: Path, arch: str = "llama", seed: int = 0,
                           tokenizer_from: Path | None = None, dtype=torch.float32,
                           max_shard_size: str | None = None, norm_noise: float = 0.0,
                           **overrides) -> Path:
    """A random model of `arch`; norm_noise > 0 also draws its norms' weights (which
    transformers starts at one, so a norm read wrongly would go unnoticed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, **overrides)).eval().to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if norm_noise and "norm" in name:
                param.add_(torch.randn_like(param) * norm_noise)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer_from is not None:
        (path / "tokenizer.json").write_bytes((tokenizer_from / "tokenizer.json").read_bytes())
    return path


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A 'draft' that mostly agrees with `src`: its weights plus Gaussian noise."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise * p.std())
    model.save_pretrained(dst)
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    return dst


def train_tokenizer(path: Path) -> Path:
    """A byte-level BPE with fewer ids than VOCAB, trained on a little Python source."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(json_module)], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def save_random_head(path: Path, target_dir: Path, kind: str = "eagle3", seed: int = 0,
                     draft_vocab: int | None = None, own_embedding: bool = False,
                     scale: float = 0.25, aux_layers: tuple[int, ...] | None = None) -> Path:
    """A draft head with random weights in `kind`'s checkpoint layout for the target in
    `target_dir` (EAGLE-3: SpecForge's names, d2t/t2d when draft_vocab is smaller)."""
    import json

    from outrider.engine.heads import head_config_json, save_head

    target = json.loads((target_dir / "config.json").read_text())
    config = head_config_json(kind, target, draft_vocab_size=draft_vocab,
                              aux_layers=aux_layers)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                           config["head_dim"])
    vocab = target["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5 * 4

    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    qkv_in = 2 * hidden if kind == "eagle3" else hidden
    t = {f"{prefix}self_attn.q_proj.weight": rand(heads * head_dim, qkv_in),
         f"{prefix}self_attn.k_proj.weight": rand(kv * head_dim, qkv_in),
         f"{prefix}self_attn.v_proj.weight": rand(kv * head_dim, qkv_in),
         f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
         f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
         f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
         f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
         f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden)}
    if kind == "eagle3":
        dv = draft_vocab or vocab
        t |= {"midlayer.input_layernorm.weight": 1 + rand(hidden),
              "midlayer.hidden_norm.weight": 1 + rand(hidden),
              "fc.weight": rand(hidden, len(aux_layers or (0, 0, 0)) * target["hidden_size"]),
              "norm.weight": 1 + rand(hidden), "lm_head.weight": rand(dv, hidden)}
        if dv != vocab:  # every other target id, from the start
            ids = torch.arange(0, 2 * dv, 2)[:dv]
            t["d2t"] = ids - torch.arange(dv)
            t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    else:
        t |= {"fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden)}
    if own_embedding:
        t["embed_tokens.weight"] = rand(vocab, hidden)
    return save_head(path, config, t)


def save_random_medusa(path: Path, target_dir: Path, num_heads: int = 3, num_layers: int = 1,
                       authors_names: bool = False, seed: int = 0) -> Path:
    """Medusa heads with random weights for the target in `target_dir`: vLLM's layout
    (MedusaModel, blocks.{k}.layers.{l}, lm_heads.{k}, no bias) or, `authors_names`, the
    Medusa authors' ({k}.{l}.linear with a bias, {k}.{num_layers} the lm_head)."""
    import json

    from outrider.engine.heads import save_head

    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    t = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            weight = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
            if authors_names:
                t[f"{k}.{layer}.linear.weight"] = weight
                t[f"{k}.{layer}.linear.bias"] = torch.randn(hidden, generator=g) * 0.1
            else:
                t[f"blocks.{k}.layers.{layer}.weight"] = weight
        lm_head = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5 * 4
        t[f"{k}.{num_layers}.weight" if authors_names else f"lm_heads.{k}.weight"] = lm_head
    config = ({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers}
              if authors_names else
              {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": num_heads,
               "num_hidden_layers": num_layers, "hidden_size": hidden, "vocab_size": vocab})
    return save_head(path, config, t)


def quantized_copy(src: Path, dst: Path, scheme: str, group_size: int | None = None) -> Path:
    """`src` quantized by compressed-tensors into its format (scripts/quantize_checkpoint.py,
    the repo's writer of the checkpoints llm-compressor makes)."""
    import importlib.util

    script = Path(__file__).parents[1] / "scripts" / "quantize_checkpoint.py"
    spec = importlib.util.spec_from_file_location("quantize_checkpoint", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.quantize(src, dst, scheme, group_size)
    return dst


def dequantized_copy(src: Path, dst: Path) -> Path:
    """A float32 checkpoint of a compressed-tensors one, each module decompressed by
    compressed-tensors itself: the reference a quantized forward is held to."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    quantization = QuantizationConfig.model_validate(config.pop("quantization_config"))
    (scheme,) = quantization.config_groups.values()  # one group: what quantized_copy writes
    compressor = BaseCompressor.get_value_from_registry(scheme.format or quantization.format)
    tensors = load_file(src / "model.safetensors")
    quantized = {name.rpartition(".")[0] for name in tensors if name.endswith(".weight_scale")}
    dense = {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()
             if name.rpartition(".")[0] not in quantized or name.endswith(".bias")}
    for prefix in quantized:
        parts = {name.rpartition(".")[2]: t.float() if name.endswith("scale") else t
                 for name, t in tensors.items() if name.rpartition(".")[0] == prefix}
        dense[f"{prefix}.weight"] = compressor.decompress(parts, scheme)["weight"].float()
    dst.mkdir(parents=True)
    save_file(dense, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(dict(config, dtype="float32")))
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    return dst
