"""A linear's quantized weight as the loaders cut it, and the matmul that serves it.

One form for every format read (formats.py) or quantized on load (`-q fp8`): levels q, a
scale and an optional zero point per (output row, group of input columns), so that w =
(q - zero) * scale; q signed integers, or FP8 values with a scale a row. Tensor-parallel
loaders slice it like a dense weight (rows for column-parallel layers, whole groups of
columns for row-parallel ones) and a fused layer's parts are stacked by row; once
loaded, a CPU layer multiplies with Outrider's 4-bit kernel (kernels/int4_gemm.cpp) or
torch's int4 or int8 weight-packed kernels (never a float weight in memory) where their
shapes allow, W8A8 with Outrider's AMX int8 kernel (kernels/int8_gemm.cpp) or oneDNN's
int8 GEMM; a CUDA device multiplies FP8 values by torch._scaled_mm (FP8 tensor cores),
4-bit levels by tinygemm and W8A8 by torch._int_mm; anything else (another shape,
act-order, FP8 on a CPU) runs with the weight dequantized once at load."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from outrider.engine.compiled import onednn_pieces
from outrider.engine.kernels import cpu_flags, cpu_kernels_loaded, runs_kernels

log = logging.getLogger(__name__)

INT4_GROUPS = (256, 128, 64, 32)  # the group sizes torch's CPU int4 kernel takes
INT4_ROWS = 16                    # its output features come in multiples of this (ours too)
INT4_GEMM_MAX_GROUP = 256         # int4_gemm's largest group (a multiple of 4)
INT8_BLOCK, INT8_DEPTH = 16, 64   # int8_gemm's outputs a block, inputs a tile product
CPU = torch.device("cpu")
CUDA_INT8_MIN_ROWS, CUDA_INT8_MULTIPLE = 16, 8  # torch._int_mm on CUDA: rows > 16, dims % 8
CUDA_INT4_OUTPUTS = 8             # tinygemm's output features come in multiples of this
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# the smallest scale a row or weight gets (vLLM's: an all-zero input still divides)
FP8_MIN_SCALE = 1 / (FP8_MAX * 512)
FP8_GEMM_CAPABILITY = (8, 9)  # CUDA devices with FP8 tensor cores: Ada, Hopper and on
FP8_GEMM_MULTIPLE = 16        # _scaled_mm's inner and output dimensions are multiples


@dataclass(frozen=True)
class QuantizedWeight:
    """w [out, in] = (q - zero) * scale, group by group along the input features."""

    q: torch.Tensor             # [out, in] int8: signed levels (4-bit: -8..7); or
    #                             float8_e4m3fn values (bits 8, a scale a row, no zero)
    scale: torch.Tensor         # [out, groups] float32
    zero: torch.Tensor | None   # [out, groups] int8 signed levels, None: symmetric
    bits: int
    group_of_column: torch.Tensor | None = None  # [in] long: act-order's groups
    int8_inputs: bool = False   # the checkpoint quantizes this layer's inputs to int8 (W8A8)
    input_scale: float | None = None  # ... by this static scale; None: a scale per row

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def is_fp8(self) -> bool:
        return self.q.is_floating_point()

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def __getitem__(self, index) -> QuantizedWeight:
        """Rows `w[a:b]`, columns `w[:, a:b]` (whole groups only) or all `w[:]`: a shard
        of its own, not a view that keeps the whole layer's levels alive on every rank."""
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        if rows == slice(None) and cols == slice(None):
            return self
        return self._cut(rows, cols).cloned()

    def cloned(self) -> QuantizedWeight:
        return replace(self, q=self.q.clone(), scale=self.scale.clone(),
                       zero=None if self.zero is None else self.zero.clone())

    def _cut(self, rows: slice, cols: slice) -> QuantizedWeight:
        part = replace(self, q=self.q[rows], scale=self.scale[rows],
                       zero=None if self.zero is None else self.zero[rows])
        if cols == slice(None):
            return part
        start, stop = cols.start or 0, cols.stop
        if part.group_of_column is not None:  # act-order: groups are looked up per column
            return replace(part, q=part.q[:, start:stop],
                           group_of_column=part.group_of_column[start:stop])
        size = self.group_size
        if part.scale.shape[1] == 1:  # one group per row (per-channel)
            return replace(part, q=part.q[:, start:stop])
        if start % size or stop % size:
            raise ValueError(f"a shard of input features {start}:{stop} cuts groups of "
                             f"{size}: choose a tensor-parallel size that divides them")
        return replace(part, q=part.q[:, start:stop], scale=part.scale[:, start // size:
                                                                       stop // size],
                       zero=None if part.zero is None else part.zero[:, start // size:
                                                                     stop // size])

    def columns_groups(self) -> torch.Tensor:
        """[in] the group of each input feature."""
        if self.group_of_column is not None:
            return self.group_of_column
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`."""
        groups = self.columns_groups()
        levels = self.q.float()
        if self.zero is not None:
            levels = levels - self.zero.float()[:, groups]
        return (levels * self.scale[:, groups]).to(dtype)


def stacked(parts: list[tuple[int, QuantizedWeight]]) -> QuantizedWeight:
    """A fused layer's parts (row offset, part) as one weight, its rows in offset order."""
    parts = [part for _, part in sorted(parts, key=lambda item: item[0])]
    if len(parts) == 1:
        return parts[0]
    if len({(p.bits, p.is_fp8, p.scale.shape[1]) for p in parts}) > 1:
        raise ValueError("the parts of a fused layer are quantized differently")
    zeros = None if all(p.zero is None for p in parts) else torch.cat(
        [torch.zeros_like(p.q[:, :p.scale.shape[1]]) if p.zero is None else p.zero
         for p in parts])
    orders = [p.group_of_column for p in parts]
    if any(o is not None for o in orders) and not all(
            o is not None and torch.equal(o, orders[0]) for o in orders):
        raise ValueError("the parts of a fused layer have different act-orders")
    int8_inputs = all(p.int8_inputs for p in parts)
    static = [p.input_scale for p in parts if p.input_scale is not None]
    return QuantizedWeight(torch.cat([p.q for p in parts]),
                           torch.cat([p.scale for p in parts]), zeros, parts[0].bits,
                           orders[0], int8_inputs,
                           # one input, one scale: the largest part's (as vLLM fuses them)
                           max(static) if int8_inputs and static else None)


class Int4Linear:
    """x [rows, in] @ a 4-bit weight, by torch's int4 weight-packed kernel: w = (u - 8) *
    scale + offset per group, u the unsigned level (q + 8), offset = -zero * scale. On
    CPUs without AVX512-BF16 (where Int4GemmLinear's kernel is not built) its CPU kernel;
    on CUDA devices from Ampere on, in bfloat16, tinygemm (gpt-fast's and torchao's
    4-bit kernel), whose packing takes the weight on the device."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, group: int,
                 device: torch.device = CPU) -> None:
        out_features, in_features = weight.shape
        scale = _scale_per_group(weight, group)  # [out, in / group]
        offset = torch.zeros_like(scale) if weight.zero is None else (
            -weight.zero.float().expand_as(scale) * scale)
        self.group, self.numel, self.cuda = group, weight.q.numel(), device.type == "cuda"
        unsigned = (weight.q.int() + 8).contiguous()  # [out, in]: levels 0..15
        if self.cuda:  # [out, in / 2] uint8, even inputs in the high nibble
            two = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8).to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                two.contiguous(), cuda_int4_tiles(in_features))
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)
        # [in / group, out, 2]: each group's scale and offset, as the kernel reads them
        self.scales_and_offsets = torch.stack([scale.t(), offset.t()], -1).to(
            dtype).contiguous().to(device)
        self.nbytes = _nbytes(self.packed, self.scales_and_offsets)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if self.cuda:  # an aten op with a meta kernel: compiles as it is
            return torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.packed, self.group,
                                                      self.scales_and_offsets)
        matmul = _int4_matmul if torch.compiler.is_compiling() else _int4_matmul_eager
        return matmul(x, self.packed, self.group, self.scales_and_offsets)


def cuda_int4_tiles(in_features: int) -> int:
    """tinygemm's inner k tiles for `in_features` inputs (each 16 inputs): the most of 8,
    4, 2 whose inputs divide them, 0 where none does."""
    return next((tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0), 0)


class Int4GemmLinear:
    """x [rows, in] bfloat16 @ a 4-bit weight, by Outrider's kernel (kernels/int4_gemm.cpp:
    AMX tile products, or AVX512-BF16 dot products, over levels turned into bfloat16 a
    group of 32 outputs at a time). 5,632 x 1,024 at group 128, two threads on two cores:
    0.097 / 0.143 / 0.79 ms at 1 / 16 / 128 rows, against torch's int4 kernel's 0.13 /
    1.04 / 8.0 and the bfloat16 weight's 0.43-0.59 / 0.42 / 1.07."""

    def __init__(self, weight: QuantizedWeight, group: int) -> None:
        scale = _scale_per_group(weight, group)  # [out, in / group]
        self.group, self.numel = group, weight.q.numel()
        self.packed = int4_layout((weight.q + 8).to(torch.uint8))  # [out / 16, in / 4, 32]
        self.scale = _by_block(scale)                              # [out / 16, groups, 16]
        self.scaled_zero = None if weight.zero is None else _by_block(
            weight.zero.float().expand_as(scale) * scale)
        self.nbytes = _nbytes(self.packed, self.scale, *(
            [] if self.scaled_zero is None else [self.scaled_zero]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        matmul = _int4_gemm if torch.compiler.is_compiling() else torch.ops.outrider_cpu.int4_gemm
        return matmul(x.contiguous(), self.packed, self.scale, self.scaled_zero, self.group)


def int4_layout(levels: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit levels [out, in] uint8 as int4_gemm reads them, [out / 16, in / 4,
    32] uint8: for 16 outputs and 4 inputs, byte j holds output j // 2's levels at input
    j % 2 (low nibble) and 2 + j % 2 (high nibble), the lanes of a bfloat16 pair product."""
    out_features, in_features = levels.shape
    # [blocks, 16 outputs, quads, half, input of the pair] -> [blocks, quads, half, 16 x 2]
    lanes = levels.contiguous().view(out_features // 16, 16, in_features // 4, 2, 2)
    lanes = lanes.permute(0, 2, 3, 1, 4)
    lanes = lanes.reshape(out_features // 16, in_features // 4, 2, 32)
    return (lanes[:, :, 0] | (lanes[:, :, 1] << 4)).contiguous()


def _by_block(per_group: torch.Tensor) -> torch.Tensor:
    """[out, groups] -> [out / 16, groups, 16] float32: a block of 16 outputs' values
    beside each other, as one vector."""
    out_features = per_group.shape[0]
    return per_group.float().view(out_features // 16, 16, -1).transpose(1, 2).contiguous()


def _int4_group(weight: QuantizedWeight) -> int:
    """The group a 4-bit kernel multiplies `weight` in: its own, or for a scale a channel
    the largest of INT4_GROUPS that divides its inputs (0: none)."""
    if weight.scale.shape[1] > 1:
        return weight.group_size
    return next((g for g in INT4_GROUPS if weight.shape[1] % g == 0), 0)


def _scale_per_group(weight: QuantizedWeight, group: int) -> torch.Tensor:
    """[out, in / group]: the weight's scales, a per-channel one repeated for each group."""
    scale = weight.scale  # [out, groups]
    if scale.shape[1] == 1:
        return scale.expand(weight.shape[0], weight.shape[1] // group)
    return scale


class Int8Linear:
    """x [rows, in] @ a symmetric per-channel 8-bit weight, by torch's CPU int8
    weight-packed kernel (activations stay in the model's dtype)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        # a copy of its own: the checkpoint's bytes may sit unaligned, and the kernel's
        # vector loads then fault
        self.q, self.numel = weight.q.clone(memory_format=torch.contiguous_format), weight.q.numel()
        self.scale = weight.scale[:, 0].to(dtype).contiguous()
        self.nbytes = _nbytes(self.q, self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        matmul = _int8_matmul if torch.compiler.is_compiling() else _int8_matmul_eager
        return matmul(x, self.q, self.scale)


class Int8Int8Linear:
    """x [rows, in] @ a symmetric per-channel 8-bit weight whose checkpoint quantizes its
    inputs to 8 bits too (W8A8): each row of x to int8 by its own scale (dynamic, per
    token) or the checkpoint's one (static), the product summed in int32, then scaled.
    Integer sums are exact, so a row's output never depends on the rows beside it (batch
    invariance, which exact speculation needs: never a scale per batch). The sums come
    from Outrider's AMX kernel (kernels/int8_gemm.cpp) where the CPU has AMX-INT8, else
    from oneDNN's int8 GEMM (VNNI; and for other dtypes, outputs not a multiple of 16 or
    inputs not of 64: a tensor-parallel shard's, say); both give the same bits. On CUDA
    (a device `has_cuda_int8_gemm`), from torch._int_mm (cuBLASLt's int8 GEMM). Two
    threads, 5,632 x 1,024, bf16 (ms): 0.10 / 0.15 / 0.17 / 0.40 by AMX at 1 / 16 / 32 /
    128 rows, 0.24 / 0.39 / 0.37 / 0.81 by oneDNN, 0.44 / 0.45 / 0.51 / 0.94 for the
    bfloat16 weight."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32,
                 device: torch.device = CPU) -> None:
        out_features, in_features = weight.shape
        self.weight_scale = weight.scale[:, 0].float().contiguous().to(device)  # [out]
        self.input_scale, self.numel = weight.input_scale, weight.q.numel()
        self.shape = weight.shape  # [out, in]
        self.nbytes = _nbytes(weight.q, self.weight_scale)
        self.cuda = device.type == "cuda"
        self.amx = (not self.cuda and dtype in (torch.bfloat16, torch.float32)
                    and has_int8_amx() and out_features % INT8_BLOCK == 0
                    and in_features % INT8_DEPTH == 0)
        if self.cuda:  # [in, out], column-major: the int8 layout cuBLASLt multiplies
            self.weight_t = weight.q.to(device).t()
        elif self.amx:
            self.packed = int8_layout(weight.q)
        else:
            self.packed = torch.ops.onednn.qlinear_prepack(weight.q.contiguous(), None)
            self.zero_points = torch.zeros(out_features, dtype=torch.long)  # symmetric

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        compiling = torch.compiler.is_compiling()
        if self.cuda:
            return _int8_cuda_matmul(x, self.weight_t, self.weight_scale, self.input_scale)
        if self.amx:
            matmul = _int8_amx_matmul if compiling else _int8_amx_matmul_eager
            return matmul(x, self.packed, self.weight_scale, self.input_scale)
        matmul = _int8_int8_matmul if compiling else _int8_int8_matmul_eager
        return matmul(x, self.packed, self.weight_scale, self.zero_points, self.input_scale)


def int8_layout(q: torch.Tensor) -> torch.Tensor:
    """int8 levels [out, in] as int8_gemm's AMX operand [out / 16, in / 4, 64]: for each
    16 outputs and 4 inputs, output j's 4 weights at bytes 4 j ... 4 j + 3."""
    out_features, in_features = q.shape
    return (q.contiguous().view(out_features // INT8_BLOCK, INT8_BLOCK, in_features // 4, 4)
            .permute(0, 2, 1, 3).reshape(out_features // INT8_BLOCK, in_features // 4, -1)
            .contiguous())


class Fp8Linear:
    """x [rows, in] @ FP8 weight values with a scale a row, by torch._scaled_mm on FP8
    tensor cores: each row of x to FP8 by its own scale (dynamic per token: a row's output
    never depends on the rows beside it, as Int8Int8Linear's), products summed in float32,
    scaled by the row's and the weight row's scales, out in bfloat16."""

    def __init__(self, weight: QuantizedWeight, device: torch.device) -> None:
        q = weight.q.to(device)  # [out, in]
        self.weight_t = q.t()    # [in, out], column-major: the layout _scaled_mm takes
        self.weight_scale = weight.scale.float().reshape(1, -1).to(device)  # [1, out]
        self.numel, self.nbytes = q.numel(), _nbytes(q, self.weight_scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        levels, scale = fp8_rows(x)
        return torch._scaled_mm(levels, self.weight_t, scale_a=scale,
                                scale_b=self.weight_scale, out_dtype=x.dtype)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> its FP8 values [rows, in] (row-major: _scaled_mm's first operand)
    and their scale [rows, 1] float32, each row's own."""
    levels, scale = _fp8_values(x, x.abs().amax(-1, keepdim=True))
    return levels.contiguous(), scale


def fp8_on_load(weight: torch.Tensor) -> QuantizedWeight:
    """A float weight [out, in] as FP8 values with one scale for the tensor (vLLM's
    `--quantization fp8` of an unquantized checkpoint). One scale a checkpoint tensor,
    taken before tensor-parallel ranks cut it, so every tp size computes the same
    weights."""
    q, scale = _fp8_values(weight, weight.abs().amax())
    return QuantizedWeight(q, scale.reshape(1, 1).expand(q.shape[0], 1).contiguous(), None, 8)


def _fp8_values(x: torch.Tensor, largest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as float8_e4m3fn values and their float32 scale, `largest` (a magnitude per row
    or for all) mapping to FP8's largest, 448."""
    scale = (largest.float() / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _int8_int8_matmul_eager(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                            zero_points: torch.Tensor, input_scale: float | None
                            ) -> torch.Tensor:
    fused = runs_kernels(x)  # one pass each way (C++) instead of ~8 small ops a linear
    levels, scale = (torch.ops.outrider_cpu.quantize_rows(x, input_scale) if fused
                     else _quantized_rows(x, input_scale))  # [rows, in] int8, [rows, 1]
    # input scale 1: the row scale multiplies after, so one primitive serves every scale
    sums = onednn_pieces(levels, lambda rows: torch.ops.onednn.qlinear_pointwise(
        rows, 1.0, 0, packed, weight_scale, zero_points, None, 1.0, 0, torch.float32,
        "none", [None], ""))  # [rows, out] float32: int32 sums times the weight's scales
    return (torch.ops.outrider_cpu.scale_rows(sums, scale, x) if fused
            else (sums * scale).to(x.dtype))


def _int8_amx_matmul_eager(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                           input_scale: float | None) -> torch.Tensor:
    levels, scale = torch.ops.outrider_cpu.quantize_rows(x, input_scale)  # [rows, in], [rows, 1]
    return torch.ops.outrider_cpu.int8_gemm(levels, scale, packed, weight_scale, x)


def _int8_cuda_matmul(x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: float | None) -> torch.Tensor:
    """x [rows, in] on CUDA -> [rows, out]: its int8 rows by torch._int_mm, which takes
    more than CUDA_INT8_MIN_ROWS rows (fewer are padded with zero rows, their sums
    dropped), then float(sum) * weight scale * row scale as on CPU."""
    levels, scale = _quantized_rows(x, input_scale)  # [rows, in] int8, [rows, 1]
    rows = x.shape[0]
    if rows <= CUDA_INT8_MIN_ROWS:
        levels = F.pad(levels, (0, 0, 0, CUDA_INT8_MIN_ROWS + 1 - rows))
    sums = torch._int_mm(levels, weight_t)[:rows]  # [rows, out] int32
    return (sums.float() * weight_scale * scale).to(x.dtype)


def _quantized_rows(x: torch.Tensor, input_scale: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> its int8 levels [rows, in] and their scale [rows, 1]."""
    if input_scale is None:  # as compressed-tensors' dynamic tokens: the largest
        # magnitude over half the 256 levels (that level then clamps to 127)
        scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / 127.5
    else:
        scale = torch.full((x.shape[0], 1), input_scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).round_().clamp_(-128, 127).to(torch.int8), scale


_int4_matmul_eager = torch.ops.aten._weight_int4pack_mm_for_cpu
_int8_matmul_eager = torch.ops.aten._weight_int8pack_mm


# Opaque custom ops inside a compiled graph, as the dense prepacked linear is
# (compiled.packed_linear); called directly in eager mode (a custom op's dispatch costs
# ~10 µs a call)
@torch.library.custom_op("outrider::int4_matmul", mutates_args=())
def _int4_matmul(x: torch.Tensor, packed: torch.Tensor, group: int,
                 scales_and_offsets: torch.Tensor) -> torch.Tensor:
    return _int4_matmul_eager(x, packed, group, scales_and_offsets)


@_int4_matmul.register_fake
def _(x, packed, group, scales_and_offsets):
    return x.new_empty(x.shape[0], scales_and_offsets.shape[1])


@torch.library.custom_op("outrider::int4_gemm", mutates_args=())
def _int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               scaled_zero: torch.Tensor | None, group: int) -> torch.Tensor:
    return torch.ops.outrider_cpu.int4_gemm(x, packed, scale, scaled_zero, group)


@_int4_gemm.register_fake
def _(x, packed, scale, scaled_zero, group):
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


@torch.library.custom_op("outrider::int8_matmul", mutates_args=())
def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _int8_matmul_eager(x, q, scale)


@_int8_matmul.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.custom_op("outrider::int8_int8_matmul", mutates_args=())
def _int8_int8_matmul(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                      zero_points: torch.Tensor, input_scale: float | None) -> torch.Tensor:
    return _int8_int8_matmul_eager(x, packed, weight_scale, zero_points, input_scale)


@_int8_int8_matmul.register_fake
def _(x, packed, weight_scale, zero_points, input_scale):
    return x.new_empty(x.shape[0], weight_scale.shape[0])


@torch.library.custom_op("outrider::int8_amx_matmul", mutates_args=())
def _int8_amx_matmul(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: float | None) -> torch.Tensor:
    return _int8_amx_matmul_eager(x, packed, weight_scale, input_scale)


@_int8_amx_matmul.register_fake
def _(x, packed, weight_scale, input_scale):
    return x.new_empty(x.shape[0], weight_scale.shape[0])


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kernel_for(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    """The matmul that keeps `weight` quantized on `device` (cpu_kernel, gpu_kernel), or
    None: it is then dequantized. A checkpoint that quantizes its inputs but whose layer
    gets no W8A8 kernel here says so once, whichever the device and the reason."""
    kernel = (cpu_kernel(weight, dtype) if device.type == "cpu"
              else gpu_kernel(weight, dtype, device) if device.type == "cuda" else None)
    if weight.int8_inputs and not isinstance(kernel, Int8Int8Linear):
        _warn_inputs_kept()
    return kernel


def _is_w8a8(weight: QuantizedWeight) -> bool:
    """Whether the int8 x int8 kernels take `weight`: 8-bit, its inputs quantized too,
    symmetric, one scale a channel."""
    return (weight.bits == 8 and weight.int8_inputs and not weight.is_fp8
            and weight.scale.shape[1] == 1 and weight.zero is None)


def cpu_kernel(weight: QuantizedWeight, dtype: torch.dtype
               ) -> Int4GemmLinear | Int4Linear | Int8Linear | Int8Int8Linear | None:
    """The CPU matmul for `weight` that never holds it in floats, or None where none takes
    it: it is then dequantized. W8A8 (inputs quantized too) by the int8 GEMM in any dtype;
    weight-only kernels for bfloat16 activations only: in float32 and float16 both take a
    scalar path here (one core, 1,024 x 5,632: 38 and 22 ms a row against 0.5 and 1.0 in
    bf16, where fp32's dense GEMM takes 2). Nor act-order's scattered groups, a group size
    or row count the int4 kernels lack, asymmetric or grouped 8-bit; nor FP8 (torch's CPU
    _scaled_mm is a reference loop: 1 s for 4 rows of 1,024 x 2,816 here)."""
    if weight.is_fp8:
        return None
    if _is_w8a8(weight) and has_int8_gemm():
        return Int8Int8Linear(weight, dtype)
    if weight.group_of_column is not None or dtype != torch.bfloat16:
        return None
    out_features, in_features = weight.shape
    if weight.bits == 4 and out_features % INT4_ROWS == 0:
        group = _int4_group(weight)
        if group <= 0 or in_features % group:  # groups that do not tile a row
            return None
        if group % 4 == 0 and group <= INT4_GEMM_MAX_GROUP and has_int4_gemm():
            return Int4GemmLinear(weight, group)
        return Int4Linear(weight, dtype, group) if group in INT4_GROUPS else None
    if weight.bits == 8 and weight.scale.shape[1] == 1 and weight.zero is None:
        return Int8Linear(weight, dtype)
    return None


def gpu_kernel(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device
               ) -> Fp8Linear | Int4Linear | Int8Int8Linear | None:
    """The CUDA matmul for `weight` that keeps it quantized, or None: it is then
    dequantized. FP8 values with a scale a row, in bfloat16, on a device with FP8 tensor
    cores, in the shapes _scaled_mm takes, where a small product of it runs; 4-bit levels
    in bfloat16 by tinygemm where its groups and shapes fit and a small product of it is
    right (not act-order's scattered groups); W8A8 by torch._int_mm. A dequantized FP8
    layer says so once (no memory or time saved)."""
    if weight.bits == 4 and not weight.is_fp8:
        return _cuda_int4(weight, dtype, device)
    if weight.bits == 8 and weight.int8_inputs and not weight.is_fp8:
        return _cuda_int8(weight, dtype, device)
    if not weight.is_fp8:
        return None
    if weight.scale.shape[1] > 1 or dtype != torch.bfloat16 or any(
            n % FP8_GEMM_MULTIPLE for n in weight.shape) or not has_fp8_gemm(device):
        _warn_fp8_dequantized(str(dtype).removeprefix("torch."))
        return None
    return Fp8Linear(weight, device)


def _cuda_int8(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device
               ) -> Int8Int8Linear | None:
    """W8A8 as on CPU, by torch._int_mm: dimensions multiples of 8 (cuBLASLt's), where a
    product of the largest levels is exact."""
    if (not _is_w8a8(weight) or weight.group_of_column is not None
            or any(n % CUDA_INT8_MULTIPLE for n in weight.shape)
            or not has_cuda_int8_gemm(device)):
        return None
    return Int8Int8Linear(weight, dtype, device)


def _cuda_int4(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device
               ) -> Int4Linear | None:
    out_features, in_features = weight.shape
    group = _int4_group(weight)
    if (weight.group_of_column is not None or dtype != torch.bfloat16
            or group not in INT4_GROUPS or in_features % group
            or out_features % CUDA_INT4_OUTPUTS or not cuda_int4_tiles(in_features)
            or not has_cuda_int4_gemm(device, group, in_features)):
        return None
    return Int4Linear(weight, dtype, group, device)


@functools.cache
def has_fp8_gemm(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 by FP8 with row-wise scales: FP8 tensor cores (not
    ROCm's, whose FP8 is another format), and a small product that runs."""
    if (torch.version.hip is not None
            or torch.cuda.get_device_capability(device) < FP8_GEMM_CAPABILITY):
        return False
    try:
        q = torch.ones(FP8_GEMM_MULTIPLE, FP8_GEMM_MULTIPLE)
        product = Fp8Linear(QuantizedWeight(q.to(torch.float8_e4m3fn),
                                            torch.ones(FP8_GEMM_MULTIPLE, 1), None, 8),
                            device)
        x = torch.ones(3, FP8_GEMM_MULTIPLE, dtype=torch.bfloat16, device=device)
        return bool((product(x) == FP8_GEMM_MULTIPLE).all())
    except RuntimeError:
        return False


@functools.cache
def has_cuda_int8_gemm(device: torch.device) -> bool:
    """Whether torch._int_mm runs on `device` (CUDA, not ROCm) and sums the largest
    products (levels 127 by -128) exactly."""
    return torch.version.hip is None and _sums_extremes_exactly(
        lambda q, x: Int8Int8Linear(QuantizedWeight(q, torch.ones(q.shape[0], 1), None, 8, None,
                                                    True, input_scale=1.0),
                                    torch.bfloat16, device)(x.to(device)))


@functools.cache
def has_cuda_int4_gemm(device: torch.device, group: int, in_features: int) -> bool:
    """Whether tinygemm runs on `device` (CUDA, compute capability 8.0 on, not ROCm) and
    a product of random levels, scales and zeros in a layer's groups and inputs (its
    tiles: cuda_int4_tiles) is the dequantized weight's."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        q = torch.randint(-8, 8, (CUDA_INT4_OUTPUTS * 4, in_features), dtype=torch.int8,
                          generator=generator)
        groups = in_features // group
        weight = QuantizedWeight(q, torch.rand(q.shape[0], groups, generator=generator) / 8,
                                 torch.randint(-2, 3, (q.shape[0], groups), dtype=torch.int8,
                                               generator=generator), 4)
        x = torch.randn(3, in_features, generator=generator).to(torch.bfloat16)
        expected = x.float() @ weight.dequantized(torch.bfloat16).float().t()
        product = Int4Linear(weight, torch.bfloat16, group, device)(x.to(device)).float().cpu()
        return bool(torch.allclose(product, expected, rtol=0.02, atol=0.02 * expected.abs().max()))
    except RuntimeError:
        return False


@functools.cache
def _warn_fp8_dequantized(dtype: str) -> None:
    log.warning("FP8 weights dequantized to %s on this GPU (FP8 tensor cores multiply them "
                "in bfloat16, scaled per tensor or channel, dimensions multiples of %d): "
                "no memory or time saved", dtype, FP8_GEMM_MULTIPLE)


@functools.cache
def _warn_inputs_kept() -> None:
    log.warning("a layer whose checkpoint quantizes its inputs to int8 runs weight-only, "
                "its inputs kept in the model's dtype (no exact int8 GEMM here, or a 4-bit, "
                "asymmetric or grouped weight): outputs nearer the float model than the "
                "checkpoint's scheme")


def has_int8_amx() -> bool:
    """Whether Outrider's AMX int8 kernel runs here: the CPU kernels loaded, built for a
    CPU with AMX-INT8, and the tiles lent by the OS (Linux from 5.16; a sandbox may
    refuse): a product of the largest levels comes out exact."""
    return cpu_kernels_loaded() and _int8_amx_runs()


@functools.cache
def _int8_amx_runs() -> bool:
    return _cpu_op_built("int8_gemm") and _sums_extremes_exactly(  # (the tiles may be refused)
        lambda q, x: torch.ops.outrider_cpu.int8_gemm(
            x.to(torch.int8), torch.ones(x.shape[0], 1), int8_layout(q),
            torch.ones(q.shape[0]), torch.ones(1)))


def has_int4_gemm() -> bool:
    """Whether Outrider's int4 kernel runs here: the CPU kernels loaded, built for a CPU
    with AVX512-BF16 (the kernel is compiled in only then)."""
    return cpu_kernels_loaded() and _cpu_op_built("int4_gemm")


def _cpu_op_built(name: str) -> bool:
    """Whether the CPU kernels' op `name` was compiled in (it is declared either way)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"outrider_cpu::{name}", "CPU")


def _sums_extremes_exactly(multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                           ) -> bool:
    """Whether an int8 GEMM sums the largest products exactly: `multiply(q, x)` of levels
    -128, q [16, 64] int8, by x [3, 64] float32 of 127s (levels 127 at the static scale 1)
    must be 127 * -128 * 64 everywhere, not saturated in 16 bits nor refused."""
    q = torch.full((INT8_BLOCK, INT8_DEPTH), -128, dtype=torch.int8)
    x = torch.full((3, INT8_DEPTH), 127.0)
    try:
        product = multiply(q, x).float().cpu()
    except (AttributeError, RuntimeError):  # an op missing from this torch, tiles refused
        return False
    return bool(torch.equal(product, torch.full((3, INT8_BLOCK), 127.0 * -128 * INT8_DEPTH)))


INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products into int32


@functools.cache
def has_int8_gemm() -> bool:
    """Whether this CPU multiplies int8 by int8 with oneDNN exactly. Without an int8 dot
    product instruction (VNNI, AMX) oneDNN sums pairs of products in 16 bits, which
    saturate silently; so the instruction is required, and the largest products (levels
    127 by -128, summed) must come out exact."""
    flags = set(cpu_flags().split())
    if not torch.backends.mkldnn.is_available() or not flags & set(INT8_DOT_FLAGS):
        return False
    return _sums_extremes_exactly(lambda q, x: _int8_int8_matmul_eager(
        x, torch.ops.onednn.qlinear_prepack(q, None), torch.ones(q.shape[0]),
        torch.zeros(q.shape[0], dtype=torch.long), 1.0))
