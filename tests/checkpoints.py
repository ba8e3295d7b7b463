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


def edit_config(model_dir: Path, **changes) -> None:
    """Change a checkpoint's config.json in place."""
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


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


def permuted_vocab_copy(src: Path, dst: Path, seed: int = 2) -> Path:
    """`src` over another vocabulary: its tokenizer's ids shuffled (special tokens kept),
    its embedding and output rows moved with them, so it models the same text; a draft
    that proposes through text (outrider/engine/cross_vocab.py)."""
    from transformers import AutoModelForCausalLM

    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["id"] for t in tok["added_tokens"]}
    ids = sorted(i for i in vocab.values() if i not in special)
    shuffled = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    new_id = {old: ids[k] for old, k in zip(ids, shuffled.tolist())}
    tok["model"]["vocab"] = {piece: new_id.get(i, i) for piece, i in vocab.items()}
    model = AutoModelForCausalLM.from_pretrained(src)
    rows = torch.arange(model.config.vocab_size)  # new id -> the row of the old one
    for old, new in new_id.items():
        rows[new] = old
    with torch.no_grad():
        weights = {id(m.weight): m.weight  # (once, when tied)
                   for m in (model.get_input_embeddings(), model.get_output_embeddings())}
        for weight in weights.values():
            weight.copy_(weight[rows])
    model.save_pretrained(dst)
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def train_tokenizer(path: Path, vocab_size: int = 300, module=None) -> Path:
    """A byte-level BPE with fewer ids than VOCAB, trained on a little Python source
    (json's, or `module`'s)."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(module or json_module)], trainer)
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


# AutoAWQ's packing order: the output column (of each eight) in a word's i-th 4 bits
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def gptq_copy(src: Path, dst: Path, bits: int = 4, group_size: int = 32, sym: bool = True,
              act_order: bool = False, checkpoint_format: str = "gptq") -> tuple[Path, Path]:
    """`src` with every decoder linear rounded to the nearest level (min-max per group, as
    GPTQ's quantizer sets its grid) and packed as GPTQ (AutoGPTQ's layout: pack_gptq,
    held bit for bit to AutoGPTQ by the golden test); act_order scatters the groups over
    the input features by a seeded permutation (g_idx). Returns the copy and, beside it,
    the same levels dequantized in float32: the reference it is held to."""
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
              "desc_act": act_order, "sym": sym, "checkpoint_format": checkpoint_format}

    def pack(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        size = weight.shape[1] if group_size == -1 else group_size
        order = (torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(0))
                 if act_order else torch.arange(weight.shape[1]))
        group_of_column = torch.empty_like(order)
        group_of_column[order] = torch.arange(weight.shape[1]) // size
        levels, zeros, scales = _rounded(weight, group_of_column, bits, sym)
        qweight, qzeros = pack_gptq(levels, zeros, bits, int(checkpoint_format == "gptq"))
        return ({"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous(),
                 "g_idx": group_of_column.int()},
                _dequantized(levels, zeros, scales, group_of_column))

    return _packed_copy(src, dst, config, pack)


def awq_copy(src: Path, dst: Path, group_size: int = 32) -> tuple[Path, Path]:
    """`src` with every decoder linear rounded (min-max per group, AutoAWQ's grid without
    its search for scales) and packed as AutoAWQ's GEMM layout (pack_awq); the copy and its
    float32 reference, as gptq_copy."""
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size,
              "zero_point": True, "version": "gemm"}

    def pack(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        group_of_column = torch.arange(weight.shape[1]) // group_size
        levels, zeros, scales = _rounded(weight, group_of_column, 4, sym=False)
        qweight, qzeros = pack_awq(levels, zeros)
        return ({"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous()},
                _dequantized(levels, zeros, scales, group_of_column))

    return _packed_copy(src, dst, config, pack)


def fp8_copy(src: Path, dst: Path, block: tuple[int, int] | None = None,
             scale_name: str | None = None, not_converted: tuple[str, ...] = ("lm_head",),
             static: bool = False) -> tuple[Path, Path]:
    """`src` with every linear but the `not_converted` ones (its modules_to_not_convert)
    cast to float8_e4m3fn as DeepSeek-V3 does: each block of `block` [rows, columns]
    (short where it does not divide the weight) over its absolute maximum / 448, the scale
    kept as weight_scale_inv; without a block one scale a tensor, kept as weight_scale
    (AutoFP8's name; `scale_name` overrides it: transformers' is weight_scale_inv). static:
    activation_scheme static, an input_scale a module. Returns the copy and, beside it,
    the copy dequantized by fp8_dequantized: the reference it is held to."""
    config = {"quant_method": "fp8", "fmt": "e4m3",
              "activation_scheme": "static" if static else "dynamic",
              "weight_block_size": list(block) if block else None,
              "modules_to_not_convert": list(not_converted)}
    scale_name = scale_name or ("weight_scale_inv" if block else "weight_scale")

    def quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        scale = torch.empty(_fp8_grid(weight.shape, block))
        q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        for (i, j), tile in _fp8_tiles(weight.shape, block):
            scale[i, j] = weight[tile].abs().amax().clamp(min=1e-12) / 448  # e4m3's largest
            q[tile] = (weight[tile] / scale[i, j]).to(torch.float8_e4m3fn)
        scale = scale if block else scale.reshape(())  # [] a tensor, as AutoFP8 keeps it
        parts = {"weight": q, scale_name: scale}
        if static:
            parts["input_scale"] = torch.tensor(0.02)
        return parts, fp8_dequantized(q, scale, block)

    def converted(name: str, tensor: torch.Tensor) -> bool:
        return (tensor.dim() == 2 and "embed_tokens" not in name
                and name.removesuffix(".weight") not in not_converted)

    return _packed_copy(src, dst, config, quantize, converted)


def fp8_dequantized(q: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None) -> torch.Tensor:
    """DeepSeek-V3's weight_dequant written out, tile by tile: each block's float8 values
    [rows, columns] times that block's scale (scale_inv multiplies), the last ones short;
    without a block, the whole tensor times its one scale."""
    dense = torch.empty(q.shape)
    grid = scale.reshape(_fp8_grid(q.shape, block))
    for (i, j), tile in _fp8_tiles(q.shape, block):
        dense[tile] = q[tile].float() * grid[i, j]
    return dense


def _fp8_grid(shape, block) -> tuple[int, int]:
    return (1, 1) if block is None else (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _fp8_tiles(shape, block):
    """((block row, block column), the weight's slices it covers) over a weight."""
    (rows, cols), (grid_rows, grid_cols) = block or shape, _fp8_grid(shape, block)
    for i in range(grid_rows):
        for j in range(grid_cols):
            yield (i, j), (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))


def pack_words(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, count] unsigned levels -> [rows, count * bits / 32] int32 words, each
    holding 32 / bits consecutive levels from its lowest bits up."""
    per_word = 32 // bits
    words = levels.long().view(levels.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, bits)
    packed = (words << shifts).sum(-1)  # [rows, words] in 0 .. 2^32 - 1
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def pack_gptq(levels: torch.Tensor, zeros: torch.Tensor, bits: int,
              zero_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels [out, in] and zero points [out, groups] -> qweight [in * bits / 32, out]
    (packed along the input rows), qzeros [groups, out * bits / 32] (along the output
    columns, each less zero_offset: v1's one)."""
    return pack_words(levels, bits).t().contiguous(), pack_words((zeros - zero_offset).t(), bits)


def pack_awq(levels: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels [out, in] and zero points [out, groups] -> qweight [in, out / 8] and qzeros
    [groups, out / 8], 4-bit, each word's output columns in AWQ_ORDER."""
    def interleaved(columns: torch.Tensor) -> torch.Tensor:  # [rows, out]
        rows = columns.shape[0]
        return columns.reshape(rows, -1, 8)[:, :, AWQ_ORDER].reshape(rows, -1)

    return pack_words(interleaved(levels.t()), 4), pack_words(interleaved(zeros.t()), 4)


def _rounded(weight: torch.Tensor, group_of_column: torch.Tensor, bits: int, sym: bool):
    """weight [out, in] -> unsigned levels [out, in], zero points [out, groups] (2^(bits-1)
    when symmetric) and fp16 scales [out, groups], from each group's min and max."""
    maxq, groups = 2 ** bits - 1, int(group_of_column.max()) + 1
    lows = torch.stack([weight[:, group_of_column == g].amin(1) for g in range(groups)], 1)
    highs = torch.stack([weight[:, group_of_column == g].amax(1) for g in range(groups)], 1)
    lows, highs = lows.clamp(max=0), highs.clamp(min=0)  # the grid holds zero
    if sym:
        highs = torch.maximum(highs, -lows)
        lows = -highs
    scales = ((highs - lows) / maxq).half().float()
    zeros = (torch.full_like(scales, 2 ** (bits - 1)) if sym
             else torch.round(-lows / scales).clamp(1, maxq))  # v1 stores zero - 1
    levels = torch.round(weight / scales[:, group_of_column]) + zeros[:, group_of_column]
    return levels.clamp(0, maxq).to(torch.uint8), zeros.to(torch.uint8), scales


def _dequantized(levels, zeros, scales, group_of_column) -> torch.Tensor:
    return (levels.float() - zeros.float()[:, group_of_column]) * scales[:, group_of_column]


def _is_decoder_linear(name: str, tensor: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _packed_copy(src: Path, dst: Path, quantization: dict, pack,
                 converted=_is_decoder_linear) -> tuple[Path, Path]:
    """`src` with each `converted` weight (by default the decoder linears') replaced by
    pack(weight)'s parts, and beside it DST-reference with it replaced by pack's
    dequantized weight."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    quantized, dense = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if converted(name, tensor):
            prefix = name.removesuffix(".weight")
            parts, dense[name] = pack(tensor.float())
            quantized |= {f"{prefix}.{part}": t for part, t in parts.items()}
        else:
            quantized[name] = dense[name] = tensor
    reference = dst.with_name(f"{dst.name}-reference")
    for folder, tensors, extra in ((dst, quantized, {"quantization_config": quantization}),
                                   (reference, dense, {})):
        folder.mkdir(parents=True)
        save_file(tensors, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config | extra))
        (folder / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    return dst, reference
