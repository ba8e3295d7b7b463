"""Quantize a Hugging Face checkpoint folder into compressed-tensors' format, as
llm-compressor writes it, for tests and benchmarks of quantized serving.

    python scripts/quantize_checkpoint.py models/demo-target /tmp/demo-w4a16 --scheme W4A16
    python scripts/quantize_checkpoint.py /tmp/llama-140m /tmp/llama-140m-w8a8 --scheme W8A8

The weights are rounded to the nearest level (min-max scales per group, channel or
tensor: what llm-compressor's QuantizationModifier does for a weight-only scheme without
calibration data, and for dynamic activation schemes, which need none); compressed-tensors
computes the scales and zero points, quantizes, packs and writes the folder and its
`quantization_config`. `lm_head` stays unquantized (llm-compressor's recipes ignore it).
Schemes: any of compressed-tensors' presets whose activations need no calibration
(W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8_BLOCK, ...); `--group-size` changes
a group scheme's group (-1: a scale per channel, W8A16's for the weight-only int8 kernel)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def quantize(source: Path, out: Path, scheme_name: str, group_size: int | None = None) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    scheme = preset_name_to_scheme(scheme_name, targets=["Linear"])
    if group_size == -1:  # GPTQ's word for a scale per output channel
        scheme.weights.strategy, scheme.weights.group_size = "channel", None
    elif group_size is not None and scheme.weights.group_size is not None:
        scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _set_weight_qparams(module, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "generation_config.json", "chat_template.jinja"):
        if (source / extra).is_file() and not (out / extra).exists():
            shutil.copy(source / extra, out / extra)


def _set_weight_qparams(module: torch.nn.Module, args) -> None:
    """The weight's scale (and zero point) from its min and max per group, channel, block
    or tensor, computed by compressed-tensors as its observers would."""
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = module.weight.float()  # [out, in]
    out_features, in_features = weight.shape
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "group":
        grouped = weight.view(out_features, in_features // args.group_size, args.group_size)
    elif strategy == "channel":
        grouped = weight.unsqueeze(1)  # [out, 1, in]
    elif strategy == "block":
        rows, cols = args.block_structure
        grouped = (weight.view(out_features // rows, rows, in_features // cols, cols)
                   .transpose(1, 2).reshape(out_features // rows, in_features // cols, -1))
    elif strategy == "tensor":
        grouped = weight.reshape(1, 1, -1)
    else:
        raise SystemExit(f"weight strategy {strategy!r} is not written by this script")
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    if strategy == "tensor":
        scale, zero_point = scale.view(1), zero_point.view(1)
    module.weight_scale.data = scale.to(module.weight_scale.dtype)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a Hugging Face checkpoint folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", default="W4A16",
                        help="a compressed-tensors preset (default: W4A16)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="the weights' group size for a group scheme (default: the "
                             "preset's, 128)")
    args = parser.parse_args()
    quantize(args.source, args.out, args.scheme, args.group_size)
    print(f"wrote {args.out} ({args.scheme})")


if __name__ == "__main__":
    main()
