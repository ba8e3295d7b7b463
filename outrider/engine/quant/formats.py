"""Reading a quantized module's tensors, as compressed-tensors writes them, into the
weight the loaders cut: pack-quantized (4- or 8-bit levels packed in int32 words, with
`weight_shape`, a scale per group, channel or tensor, a packed zero point when
asymmetric, `weight_g_idx` under act-order), int-quantized (int8 levels in `weight`) and
float-quantized (FP8 `weight` with a scale per tensor, channel or block: dequantized
here, since no CPU computes in FP8). Static activation scales (`input_scale`) are read
and not used: activations stay in the model's dtype (weight-only compute)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from outrider.engine.checkpoint import CheckpointError, tensor_names
from outrider.engine.quant.scheme import QuantScheme
from outrider.engine.quant.weight import QuantizedWeight

# the tensors a quantized module may have besides its bias
PARTS = frozenset({"weight", "weight_packed", "weight_scale", "weight_zero_point",
                   "weight_shape", "weight_g_idx", "input_scale", "input_zero_point"})
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantized_tensor_slices(model_dir: Path, slices: Iterator[tuple[str, object]],
                            scheme: QuantScheme) -> Iterator[tuple[str, object]]:
    """`slices` with each quantized module's parts replaced by one `PREFIX.weight`: a
    QuantizedWeight, or a dense float tensor (FP8), yielded once its last part is read."""
    names_of: dict[str, set[str]] = {}  # module prefix -> its tensors' names, bias aside
    for name in tensor_names(model_dir):
        if not name.endswith(".bias"):
            names_of.setdefault(name.rpartition(".")[0], set()).add(name)
    parts_of = {prefix: names for prefix, names in names_of.items()
                if f"{prefix}.weight_scale" in names}  # the quantized modules'
    read: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor_slice in slices:
        prefix, _, part = name.rpartition(".")
        if prefix not in parts_of or part == "bias":
            yield name, tensor_slice
            continue
        if part not in PARTS:
            raise CheckpointError(f"{model_dir}: unexpected tensor {name!r} of a quantized "
                                  f"module (a format this loader does not know)")
        read.setdefault(prefix, {})[part] = tensor_slice[:]
        if len(read[prefix]) == len(parts_of[prefix]):
            try:
                yield f"{prefix}.weight", read_module(read.pop(prefix), scheme.block)
            except KeyError as exc:
                raise CheckpointError(f"{model_dir}: quantized module {prefix!r} lacks its "
                                      f"{exc} tensor") from exc
            except (ValueError, RuntimeError) as exc:
                raise CheckpointError(f"{model_dir}: quantized module {prefix!r}: "
                                      f"{exc}") from exc


def read_module(tensors: dict[str, torch.Tensor],
                block: tuple[int, int] | None = None) -> QuantizedWeight | torch.Tensor:
    """One module's parts -> its QuantizedWeight (integer levels) or dense weight (FP8;
    `block`: its scales' [rows, columns] where block-wise)."""
    if "weight_packed" in tensors:
        out_features, in_features = (int(n) for n in tensors["weight_shape"].tolist())
        bits = _packed_bits(tensors["weight_packed"], in_features)
        q = _signed(unpack(tensors["weight_packed"], bits, in_features), bits)
        zero = tensors.get("weight_zero_point")
        if zero is not None and zero.dtype == torch.int32:  # packed along the output rows
            zero = _signed(unpack(zero.t(), bits, out_features), bits).t()
    elif "weight" in tensors and tensors["weight"].dtype in FP8:
        weight = tensors["weight"]
        return weight.float() * _spread(tensors["weight_scale"].float(), weight.shape, block)
    elif "weight" in tensors and tensors["weight"].dtype == torch.int8:
        q, bits, zero = tensors["weight"], 8, tensors.get("weight_zero_point")
    else:
        raise ValueError(f"neither packed, int8 nor FP8 weights among {sorted(tensors)}")
    scale = _per_row(tensors["weight_scale"].float(), q.shape[0])
    if zero is not None:
        zero = _per_row(zero, q.shape[0]).to(torch.int8)
        zero = None if not zero.any() else zero
    return QuantizedWeight(q, scale, zero, bits, _act_order(tensors.get("weight_g_idx"),
                                                            q.shape[1], scale.shape[1]))


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
    """An FP8 weight's scale per tensor, channel or block -> one per weight (shape). The
    last blocks of a dimension the block does not divide are short."""
    if scale.numel() == 1 or scale.numel() == shape[0]:
        return scale.reshape(-1, 1)
    if block is None:
        raise ValueError(f"weight_scale of shape {tuple(scale.shape)} for a weight of "
                         f"{tuple(shape)}, and no block_structure in the config")
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return scale[rows][:, cols]


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
