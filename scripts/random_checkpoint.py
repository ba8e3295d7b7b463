"""Write a randomly initialised Hugging Face checkpoint of an architecture Outrider loads,
sized like the demo target and carrying its tokenizer, for benchmarks of architectures
the repo ships no trained model of (e.g. `outrider bench --step --target DIR` on routed
experts).

    python scripts/random_checkpoint.py mixtral /tmp/mixtral-demo
    python scripts/random_checkpoint.py qwen3_moe /tmp/qwen3-moe-demo
    python scripts/random_checkpoint.py llama /tmp/llama-140m --size 140m

Shapes: 4 layers, hidden 256, 8 heads (2 KV heads), the demo's 4,096-token vocabulary;
the MoE kinds 8 experts of 896 features, top-2 (Mixtral's ratios); bfloat16. `--size 140m`:
a model where the forward dominates a step (hidden 1,024, 12 layers, 16 heads (4 KV
heads), MLP 2,816: ~140M parameters, 280 MB in bfloat16). `--size 1b`: Llama-3.2-1B's
shape (scripts/gpu_check.py --mid writes it on the GPU, with a draft of its first layer)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from outrider import paths

SHAPES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
              eos_token_id=2)
KINDS = {
    "llama": ("LlamaConfig", dict(intermediate_size=896)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=896)),
    "mistral": ("MistralConfig", dict(intermediate_size=896, sliding_window=1024)),
    "gemma2": ("Gemma2Config", dict(intermediate_size=896, head_dim=32,
                                    query_pre_attn_scalar=32, sliding_window=1024)),
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=896, head_dim=32,
                                        query_pre_attn_scalar=32, sliding_window=1024)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=896, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=896, moe_intermediate_size=896,
                                         num_experts=8, num_experts_per_tok=2, head_dim=32,
                                         norm_topk_prob=True)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=896, head_dim=32)),
    "phi3": ("Phi3Config", dict(intermediate_size=896, pad_token_id=0, sliding_window=1024)),
}
SIZES = {"demo": {}, "140m": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                                  num_key_value_heads=4, intermediate_size=2816),
         # Llama-3.2-1B's shape with a 32,000-token vocabulary: 1.04B parameters, 2.1 GB
         "1b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                    tie_word_embeddings=True, max_position_embeddings=4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("out")
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--draft-layers", type=int, metavar="N",
                        help="also write OUT-draft: the model's first N layers and its "
                             "embeddings (a draft that shares them)")
    args = parser.parse_args()
    model = write(args.kind, Path(args.out), args.size)
    if args.draft_layers:
        write_layer_draft(model, Path(f"{args.out}-draft"), args.draft_layers)


def write(kind: str, out: Path, size: str = "demo", device: str = "cpu",
          quieter_after: int = 0):
    """A random `kind` model of `size` in bfloat16 (made on `device`), saved to `out`
    with the demo's tokenizer where the vocabularies agree. quieter_after > 0: the
    layers past that many add a tenth of what they would to the residual stream (their
    output projections scaled), so a draft of the first layers agrees with the whole
    model often enough to measure speculation on random weights."""
    import transformers

    config_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**{**SHAPES, **extra, **SIZES[size]})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers[quieter_after:] if quieter_after else ():
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    model.save_pretrained(out)
    if config.vocab_size == SHAPES["vocab_size"]:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (paths.demo_target_dir() / name).is_file():
                shutil.copy(paths.demo_target_dir() / name, out / name)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
    return model


def write_layer_draft(model, out: Path, layers: int) -> None:
    """`model`'s first `layers` layers, its embeddings, final norm and head, saved to
    `out` as a model of its own."""
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
