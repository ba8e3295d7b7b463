"""Reading a quantized module's tensors into the one weight the loaders cut, by the
format the scheme names (FORMATS: the parts that mark a quantized module, the parts it
may have, and its reader):

- compressed-tensors: pack-quantized (4- or 8-bit levels packed in int32 words, with
  `weight_shape`, a scale per group, channel or tensor, a packed zero point when
  asymmetric, `weight_g_idx` under act-order), int-quantized (int8 levels in `weight`)
  and float-quantized (FP8 `weight` with a scale per tensor, channel or block: a block's
  dequantized here). Where the scheme quantizes 8-bit
  weights' inputs to 8-bit ints too (W8A8), the weight says so, with the static
  `input_scale` if the scheme has one (weight.Int8Int8Linear multiplies them).
- GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` [in * bits / 32, out] int32, levels
  packed along the input rows; `qzeros` [groups, out * bits / 32], packed along the
  output columns, each stored less one by v1 (`checkpoint_format` gptq) and as it is by
  gptq_v2; `scales` [groups, out]; `g_idx` [in], each input feature's group (act-order).
- AWQ (AutoAWQ's GEMM layout): `qweight` [in, out / 8] int32 and `qzeros` [groups, out /
  8], 4-bit levels packed along the output columns in AWQ's interleaved order;
  `scales` [groups, out].
- fp8 (DeepSeek-V3, Qwen3-*-FP8; vLLM's `fp8` method): `weight` [out, in]
  float8_e4m3fn with `weight_scale_inv` [ceil(out / rows), ceil(in / columns)] float32,
  a scale per block of the config's `weight_block_size`, which multiplies despite its
  name (DeepSeek-V3's weight_dequant), or `weight_scale`, one a tensor (AutoFP8's);
  blocks dequantized here, `input_scale` (static activations) read and not used.

An FP8 weight scaled per tensor or channel stays FP8 values in a QuantizedWeight, which a
GPU with FP8 arithmetic multiplies as they are (weight.Fp8Linear) and any other device
dequantizes once at load.

Every word holds 32 / bits levels from its lowest bits up, unsigned; w = (level - zero) *
scale (compressed-tensors' symmetric levels are offset by 2^(bits-1) instead)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from outrider.engine.checkpoint import CheckpointError, tensor_names
from outrider.engine.quant.scheme import QuantScheme
from outrider.engine.quant.weight import QuantizedWeight

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# AutoAWQ's packing order: the output column (of each eight) in a word's i-th 4 bits
AWQ_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])


@dataclass(frozen=True)
class ModuleFormat:
    """How one format stores a quantized module."""

    markers: tuple[str, ...]  # the parts only a quantized module has (any one of them)
    parts: frozenset[str]   # every part it may have, its bias aside
    read: Callable[[dict[str, torch.Tensor], QuantScheme], QuantizedWeight | torch.Tensor]


def quantized_tensor_slices(model_dir: Path, slices: Iterator[tuple[str, object]],
                            scheme: QuantScheme) -> Iterator[tuple[str, object]]:
    """`slices` with each quantized module's parts replaced by one `PREFIX.weight`: a
    QuantizedWeight, or a dense float tensor (block-wise FP8), yielded once its last part
    is read."""
    fmt = FORMATS[scheme.format]
    names_of: dict[str, set[str]] = {}  # module prefix -> its tensors' names, bias aside
    for name in tensor_names(model_dir):
        if not name.endswith(".bias"):
            names_of.setdefault(name.rpartition(".")[0], set()).add(name)
    parts_of = {prefix: names for prefix, names in names_of.items()
                if any(f"{prefix}.{marker}" in names for marker in fmt.markers)}
    read: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor_slice in slices:
        prefix, _, part = name.rpartition(".")
        if prefix not in parts_of or part == "bias":
            yield name, tensor_slice
            continue
        if part not in fmt.parts:
            raise CheckpointError(f"{model_dir}: unexpected tensor {name!r} of a quantized "
                                  f"module (a format this loader does not know)")
        read.setdefault(prefix, {})[part] = tensor_slice[...]  # whole, a 0-dim scale too
        if len(read[prefix]) == len(parts_of[prefix]):
            try:
                yield f"{prefix}.weight", fmt.read(read.pop(prefix), scheme)
            except KeyError as exc:
                raise CheckpointError(f"{model_dir}: quantized module {prefix!r} lacks its "
                                      f"{exc} tensor") from exc
            except (ValueError, RuntimeError) as exc:
                raise CheckpointError(f"{model_dir}: quantized module {prefix!r}: "
                                      f"{exc}") from exc


def read_compressed_tensors(tensors: dict[str, torch.Tensor],
                            scheme: QuantScheme) -> QuantizedWeight | torch.Tensor:
    """One module's parts -> its QuantizedWeight (integer levels, FP8 values) or dense
    weight (FP8 in blocks of the scheme's block)."""
    if "weight_packed" in tensors:
        out_features, in_features = (int(n) for n in tensors["weight_shape"].tolist())
        bits = _packed_bits(tensors["weight_packed"], in_features)
        q = _signed(unpack(tensors["weight_packed"], bits, in_features), bits)
        zero = tensors.get("weight_zero_point")
        if zero is not None and zero.dtype == torch.int32:  # packed along the output rows
            zero = _signed(unpack(zero.t(), bits, out_features), bits).t()
    elif "weight" in tensors and tensors["weight"].dtype in FP8:
        return _fp8_weight(tensors["weight"], tensors["weight_scale"], scheme.block)
    elif "weight" in tensors and tensors["weight"].dtype == torch.int8:
        q, bits, zero = tensors["weight"], 8, tensors.get("weight_zero_point")
    else:
        raise ValueError(f"neither packed, int8 nor FP8 weights among {sorted(tensors)}")
    weight = _levels_weight(q, tensors["weight_scale"], zero, bits, tensors.get("weight_g_idx"))
    if scheme.int8_inputs is None or bits != 8:
        return weight
    return replace(weight, int8_inputs=True, input_scale=None if scheme.int8_inputs ==
                   "dynamic" else float(tensors["input_scale"].float().max()))


def read_fp8(tensors: dict[str, torch.Tensor],
             scheme: QuantScheme) -> QuantizedWeight | torch.Tensor:
    """fp8's parts -> the weight: float8_e4m3fn values and the tensor's `weight_scale`,
    or dense, the values times their block's `weight_scale_inv` (a multiplier: DeepSeek-V3
    divided by it to quantize)."""
    weight = tensors["weight"]  # [out, in]
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight is {weight.dtype}, not the float8_e4m3fn the config's "
                         f"fmt e4m3 says")
    scales = [tensors[part] for part in FP8_SCALES if part in tensors]
    if len(scales) != 1:
        raise ValueError("both weight_scale_inv and weight_scale: which one scales it?")
    if not scales[0].is_floating_point():  # e.g. MXFP8's exponent bytes
        raise ValueError(f"a weight scale of {scales[0].dtype} is not supported (only float)")
    return _fp8_weight(weight, scales[0], scheme.block)


def _fp8_weight(weight: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int] | None) -> QuantizedWeight | torch.Tensor:
    """FP8 values [out, in] and their scale: per tensor or channel, the values kept with
    a scale a row; per block (a config with a block size: every tensor alike, so that a
    fused layer's parts come out alike), dequantized to float32."""
    spread = _spread(scale.float(), weight.shape, block)  # [1, 1], [out, 1] or [out, in]
    if block is not None or spread.shape[1] > 1:
        return weight.float() * spread
    return QuantizedWeight(weight.contiguous(), spread.expand(weight.shape[0], 1).contiguous(),
                           None, 8)


def read_gptq(tensors: dict[str, torch.Tensor], scheme: QuantScheme,
              zero_offset: int) -> QuantizedWeight:
    """GPTQ's parts -> its QuantizedWeight; `zero_offset`: what the format took from each
    stored zero point (v1: one)."""
    bits, qweight = scheme.bits, tensors["qweight"]  # [in * bits / 32, out]
    in_features = qweight.shape[0] * 32 // bits
    group_of_column = tensors.get("g_idx")  # [in]
    if group_of_column is not None and group_of_column.shape[0] != in_features:
        raise ValueError(f"qweight has {qweight.shape[0]} words a column for "
                         f"{group_of_column.shape[0]} input features (g_idx): not {bits}-bit "
                         f"levels")
    q = unpack(qweight.t(), bits, in_features)  # [out, in]
    scale = tensors["scales"].t()  # [out, groups]
    # v1's zero points are one more than stored, unmasked as its writers read them back
    # (only a zero of 0 would wrap, and v1's packers spoil that one's word anyway)
    zero = unpack(tensors["qzeros"], bits, scale.shape[0]).t() + zero_offset  # [out, groups]
    return _levels_weight(_signed(q, bits), scale, _signed(zero, bits), bits, group_of_column)


def read_awq(tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight:
    """AWQ's GEMM parts -> its QuantizedWeight (groups in column order: no act-order)."""
    bits, qweight = scheme.bits, tensors["qweight"]  # [in, out * bits / 32]
    out_features = qweight.shape[1] * 32 // bits
    q = _awq_columns(unpack(qweight, bits, out_features)).t()  # [out, in]
    zero = _awq_columns(unpack(tensors["qzeros"], bits, out_features)).t()  # [out, groups]
    return _levels_weight(_signed(q, bits), tensors["scales"].t(), _signed(zero, bits), bits)


def _awq_columns(levels: torch.Tensor) -> torch.Tensor:
    """[rows, out] levels in AWQ's packing order -> in output-column order."""
    rows, columns = levels.shape
    words = levels.view(rows, columns // len(AWQ_ORDER), len(AWQ_ORDER))
    ordered = torch.empty_like(words)
    ordered[:, :, AWQ_ORDER] = words  # the i-th levels of a word are column AWQ_ORDER[i]
    return ordered.view(rows, columns)


def _levels_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   bits: int, group_of_column: torch.Tensor | None = None) -> QuantizedWeight:
    """Signed levels q [out, in], a scale and signed zero point per tensor, channel or
    group, act-order's group per column -> one QuantizedWeight (an all-zero zero point is
    none: symmetric)."""
    scale = _per_row(scale.float(), q.shape[0])
    if zero is not None:
        zero = _per_row(zero, q.shape[0]).to(torch.int8)
        zero = None if not zero.any() else zero.contiguous()
    return QuantizedWeight(q.contiguous(), scale.contiguous(), zero, bits,
                           _act_order(group_of_column, q.shape[1], scale.shape[1]))


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[rows, words] int32, each word holding 32 / bits levels from its lowest bits up ->
    [rows, count] unsigned levels (int16)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    levels = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per word]
    return levels.reshape(packed.shape[0], -1)[:, :count].to(torch.int16)


def _packed_bits(packed: torch.Tensor, in_features: int) -> int:
    for bits in (4, 8):
        if packed.shape[1] == -(-in_features * bits // 32):
            return bits
    raise ValueError(f"weight_packed has {packed.shape[1]} words a row for {in_features} "
                     f"input features: not 4- or 8-bit levels")


def _signed(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned levels, as packed with an offset of 2^(bits-1) -> signed int8."""
    return (levels - (1 << (bits - 1))).to(torch.int8)


def _per_row(values: torch.Tensor, rows: int) -> torch.Tensor:
    """A scale or zero point per tensor [1] or [], channel [out] or [out, 1], or group
    [out, groups] -> [out, groups]."""
    if values.numel() == 1:
        return values.reshape(1, 1).expand(rows, 1).contiguous()
    return values.reshape(rows, -1)


def _spread(scale: torch.Tensor, shape: torch.Size,
            block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 weight's scale per tensor, block or channel -> one per weight (shape). The
    last blocks of a dimension the block does not divide are short."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    # blocks first: a grid of as many scales as rows (e.g. [2, 16] for [32, 256] in
    # blocks of 16) is no scale a channel
    grid = None if block is None else (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if grid is not None and tuple(scale.shape) == grid:
        rows = torch.arange(shape[0]) // block[0]
        cols = torch.arange(shape[1]) // block[1]
        return scale[rows][:, cols]
    if scale.numel() == shape[0]:
        return scale.reshape(-1, 1)
    raise ValueError(f"a weight scale of shape {tuple(scale.shape)} for a weight of "
                     f"{tuple(shape)}: not one a tensor, a channel"
                     + (f" or a block of {block[0]} x {block[1]} ({grid[0]} x {grid[1]})"
                        if block else " (and the config gives no block size)"))


def _act_order(group_of_column: torch.Tensor | None, in_features: int,
               groups: int) -> torch.Tensor | None:
    """Act-order's group per input feature, or None where it is the plain one."""
    if group_of_column is None or groups == 1:
        return None
    group_of_column = group_of_column.long()
    if (group_of_column < 0).any():  # written but unused
        return None
    plain = torch.arange(in_features) // (in_features // groups)
    return None if torch.equal(group_of_column, plain) else group_of_column


# the tensors a compressed-tensors quantized module may have besides its bias
COMPRESSED_TENSORS_PARTS = frozenset({
    "weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
    "weight_g_idx", "input_scale", "input_zero_point"})
GPTQ_PARTS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
FP8_SCALES = ("weight_scale_inv", "weight_scale")  # per block (DeepSeek's), per tensor
FORMATS = {
    "compressed-tensors": ModuleFormat(("weight_scale",), COMPRESSED_TENSORS_PARTS,
                                       read_compressed_tensors),
    "gptq": ModuleFormat(("qweight",), GPTQ_PARTS, partial(read_gptq, zero_offset=1)),
    "gptq_v2": ModuleFormat(("qweight",), GPTQ_PARTS, partial(read_gptq, zero_offset=0)),
    "awq": ModuleFormat(("qweight",), frozenset({"qweight", "qzeros", "scales"}), read_awq),
    "fp8": ModuleFormat(FP8_SCALES, frozenset({"weight", *FP8_SCALES, "input_scale"}),
                        read_fp8),
}
