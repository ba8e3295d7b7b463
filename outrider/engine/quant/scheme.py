"""What a checkpoint's `quantization_config` says, and whether it can be served.

Four methods load: compressed-tensors (llm-compressor's), GPTQ (AutoGPTQ's, GPTQModel's,
optimum's), AWQ (AutoAWQ's GEMM layout) and fp8 (DeepSeek-V3's, Qwen3-*-FP8's: what
vLLM's `fp8` method and transformers' FineGrainedFP8 read). The scheme names the format
whose reader turns each module's tensors into one weight (formats.py); the tensors say
the rest of a compressed-tensors module's scheme (bits from the packed width, group size
from the scale's, a zero point by its presence), so mixed schemes load as one. This file
refuses, at start and naming it, what no reader here understands."""

from __future__ import annotations

from dataclasses import dataclass

COMPRESSED_TENSORS_FORMATS = ("pack-quantized", "int-quantized", "float-quantized",
                              "naive-quantized")
INT_BITS = (4, 8)  # packed along 32-bit words without straddling; 4-bit: CPU kernels too
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point less one; v2 as it is
AWQ_BITS = (4,)   # AutoAWQ's GEMM layout interleaves 4-bit levels only
FP8_FORMATS = ("e4m3",)  # float8_e4m3fn, what vLLM's fp8 method reads too
FP8_ACTIVATION_SCHEMES = ("dynamic", "static")  # activations stay in the model's dtype


class QuantizationError(ValueError):
    """A quantization_config that is malformed or asks for what cannot be served."""


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization, in the few words a log line and an error need."""

    description: str               # e.g. "4-bit int weights, group size 128, pack-quantized"
    block: tuple[int, int] | None = None  # block-wise FP8's [rows, columns] per scale
    format: str = "compressed-tensors"  # its reader (formats.FORMATS), or gptq, awq, fp8, ...
    bits: int | None = None        # GPTQ's and AWQ's, which their packed tensors do not say
    int8_inputs: str | None = None  # "dynamic" or "static": 8-bit symmetric int activations
    on_load: bool = False          # an unquantized checkpoint's linears quantized as they load


# vLLM's `--quantization` methods that quantize an unquantized checkpoint as it loads
FP8_ON_LOAD = QuantScheme("fp8 quantized on load (e4m3 weights, a scale a tensor, dynamic "
                          "activations)", format="fp8", on_load=True)
ON_LOAD = {"fp8": FP8_ON_LOAD}


def parse_quantization(config) -> QuantScheme:
    """The scheme of a config.json's `quantization_config`, or QuantizationError naming
    what is not supported."""
    if not isinstance(config, dict):
        raise QuantizationError("quantization_config is not an object")
    method = str(config.get("quant_method", "unnamed method"))
    if method == "gptq":
        return _parse_gptq(config)
    if method == "awq":
        return _parse_awq(config)
    if method == "fp8":
        return _parse_fp8(config)
    if method != "compressed-tensors":
        raise QuantizationError(
            f"{describe(config)}: {method} checkpoints are not loaded yet (compressed-tensors "
            f"ones are: llm-compressor's W4A16, W8A16, W8A8 and FP8; and GPTQ, AWQ and fp8)")
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
    return QuantScheme(describe(config).removeprefix(f"{method}, "), next(iter(blocks), None),
                       int8_inputs=_int8_inputs(groups.values()))


def _int8_inputs(groups) -> str | None:
    """"dynamic" or "static" where every group quantizes its input activations to
    symmetric 8-bit ints (llm-compressor's W8A8), else None: activations then stay in the
    model's dtype (asymmetric or mixed ones included)."""
    kinds = set()
    for group in groups:
        inputs = group.get("input_activations") or {}
        if (inputs.get("type", "int"), inputs.get("num_bits"), inputs.get("symmetric", True)) \
                != ("int", 8, True):
            return None
        kinds.add("dynamic" if inputs.get("dynamic") else "static")
    return kinds.pop() if len(kinds) == 1 else None


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


def _parse_gptq(config: dict) -> QuantScheme:
    """GPTQ as AutoGPTQ, GPTQModel and optimum write it: levels packed along the input
    rows, its own bits for every module (a `dynamic` override per module is refused)."""
    fmt = ("marlin" if config.get("is_marlin_format")  # AutoGPTQ's older word for it
           else str(config.get("checkpoint_format") or config.get("format") or "gptq"))
    if fmt not in GPTQ_FORMATS:
        raise QuantizationError(f"{describe(config)}: checkpoint format {fmt!r} is not "
                                f"supported (only {', '.join(GPTQ_FORMATS)})")
    _check_bits(config, INT_BITS)
    if config.get("pack_dtype", "int32") != "int32":
        raise QuantizationError(f"{describe(config)}: pack_dtype {config['pack_dtype']!r} is "
                                f"not supported (only int32)")
    if config.get("dynamic"):
        raise QuantizationError(f"{describe(config)}: dynamic (per-module) overrides are not "
                                f"supported")
    return QuantScheme(describe(config).removeprefix("gptq, "), format=fmt,
                       bits=config["bits"])


def _parse_awq(config: dict) -> QuantScheme:
    """AWQ as AutoAWQ writes it for its GEMM kernel (what vLLM's `awq` reads)."""
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version != "gemm":
        raise QuantizationError(f"{describe(config)}: version {version!r} is not supported "
                                f"(only gemm)")
    _check_bits(config, AWQ_BITS)
    if config.get("zero_point") is False:
        raise QuantizationError(f"{describe(config)}: zero_point false is not supported")
    return QuantScheme(describe(config).removeprefix("awq, "), format="awq",
                       bits=config["bits"])


def _parse_fp8(config: dict) -> QuantScheme:
    """fp8 as DeepSeek-V3 and Qwen3-*-FP8 ship it: float8_e4m3fn weights, a scale per
    block of `weight_block_size` or, without one, per tensor. Which modules stay dense
    (`modules_to_not_convert`, `ignored_layers`) their tensors say: no scale."""
    fmt = config.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise QuantizationError(f"{describe(config)}: fmt {fmt!r} is not supported (only "
                                f"{', '.join(FP8_FORMATS)})")
    activations = config.get("activation_scheme", "dynamic")
    if activations not in FP8_ACTIVATION_SCHEMES:
        raise QuantizationError(f"{describe(config)}: activation_scheme {activations!r} is "
                                f"not supported (only {', '.join(FP8_ACTIVATION_SCHEMES)})")
    return QuantScheme(describe(config).removeprefix("fp8, "),
                       _fp8_block(config), format="fp8")


def _fp8_block(config: dict) -> tuple[int, int] | None:
    """weight_block_size [rows, columns] a scale covers, or None: one scale a tensor."""
    block = config.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(type(n) is int and n > 0 for n in block)):  # (a bool is no size)
        raise QuantizationError(f"{describe(config)}: weight_block_size {block!r} is not two "
                                f"positive integers")
    return block[0], block[1]


def _check_bits(config: dict, supported: tuple[int, ...]) -> None:
    if config.get("bits") not in supported:
        raise QuantizationError(
            f"{describe(config)}: {config.get('bits')}-bit weights are not supported (only "
            f"{' and '.join(str(b) for b in supported)}-bit)")


def describe(config) -> str:
    """A quantization_config in a few words: its method and, where it says them, the
    weights' bits and group size and its format (compressed-tensors, AWQ, GPTQ), fp8's
    weight format, blocks and activation scheme."""
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
    if spec.get("group_size") == -1:  # GPTQ's word for a scale per channel
        words.append("per channel")
    elif spec.get("group_size"):
        words.append(f"group size {spec['group_size']}")
    for key in ("format", "checkpoint_format", "version"):
        if config.get(key) and f"format {config[key]}" not in words:
            words.append(f"format {config[key]}")
    if config.get("desc_act"):
        words.append("act-order")
    if config.get("fmt"):  # fp8's
        words.append(f"{config['fmt']} weights")
    if config.get("weight_block_size"):
        words.append(f"weight_block_size {config['weight_block_size']}")
    if config.get("activation_scheme"):
        words.append(f"{config['activation_scheme']} activations")
    return ", ".join(words)
