"""What a checkpoint's `quantization_config` says, and whether it can be served.

The tensors themselves say most of a compressed-tensors module's scheme (bits from the
packed width, group size from the scale's, a zero point by its presence: formats.py), so
mixed schemes load as one; this file refuses, at start and naming it, what no reader here
understands."""

from __future__ import annotations

from dataclasses import dataclass

COMPRESSED_TENSORS_FORMATS = ("pack-quantized", "int-quantized", "float-quantized",
                              "naive-quantized")
INT_BITS = (4, 8)  # packed along 32-bit words without straddling; 4-bit: CPU kernels too


class QuantizationError(ValueError):
    """A quantization_config that is malformed or asks for what cannot be served."""


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization, in the few words a log line and an error need."""

    description: str               # e.g. "4-bit int weights, group size 128, pack-quantized"
    block: tuple[int, int] | None = None  # block-wise FP8's [rows, columns] per scale


def parse_quantization(config) -> QuantScheme:
    """The scheme of a config.json's `quantization_config`, or QuantizationError naming
    what is not supported."""
    if not isinstance(config, dict):
        raise QuantizationError("quantization_config is not an object")
    method = str(config.get("quant_method", "unnamed method"))
    if method != "compressed-tensors":
        raise QuantizationError(
            f"{describe(config)}: {method} checkpoints are not loaded yet (compressed-tensors "
            f"ones are: llm-compressor's W4A16, W8A16, W8A8 and FP8)")
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{describe(config)}: no config_groups")
    for name, group in groups.items():
        _check_group(name, group, config)
    for unsupported in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        if config.get(unsupported):
            raise QuantizationError(f"{describe(config)}: {unsupported} is not supported")
    blocks = {tuple(g["weights"]["block_structure"]) for g in groups.values()
              if g["weights"].get("block_structure")}
    if len(blocks) > 1:
        raise QuantizationError(f"{describe(config)}: several block structures")
    return QuantScheme(describe(config).removeprefix(f"{method}, "), next(iter(blocks), None))


def _check_group(name: str, group, config: dict) -> None:
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise QuantizationError(f"{describe(config)}: config group {name!r} has no weights")
    weights = group["weights"]
    fmt = group.get("format") or config.get("format")
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise QuantizationError(f"{describe(config)}: format {fmt!r} is not supported (only "
                                f"{', '.join(COMPRESSED_TENSORS_FORMATS)})")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if (kind, bits) not in [("int", b) for b in INT_BITS] + [("float", 8)]:
        raise QuantizationError(
            f"{describe(config)}: {bits}-bit {kind} weights are not supported (only 4- and "
            f"8-bit int, and 8-bit float)")
    if weights.get("strategy") == "block" and kind == "int":
        raise QuantizationError(f"{describe(config)}: block-wise int weights are not supported")


def describe(config) -> str:
    """A quantization_config in a few words: its method and, where it says them, the
    weights' bits and group size and its format (compressed-tensors, AWQ, GPTQ, fp8)."""
    if not isinstance(config, dict):
        return "quantization_config"
    words = [str(config.get("quant_method", "unnamed method"))]
    groups = config.get("config_groups") or {}
    weights = next((g.get("weights") for g in groups.values()
                    if isinstance(g, dict) and isinstance(g.get("weights"), dict)), None)
    spec = weights or config
    if spec.get("num_bits") or spec.get("bits"):
        words.append(f"{spec.get('num_bits') or spec.get('bits')}-bit "
                     f"{spec.get('type', 'int') if weights else 'int'} weights")
    if spec.get("group_size"):
        words.append(f"group size {spec['group_size']}")
    if config.get("format"):
        words.append(f"format {config['format']}")
    return ", ".join(words)
