"""Tensor parallelism as layer types.

Each parallel layer owns the rule for cutting its shard out of a full checkpoint tensor
(`weight_loader`), so the model reads like single-device code. Checkpoint tensors arrive
as lazy safetensors slices: a rank reads only the rows or columns it keeps.
Collectives go through torch.distributed (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from outrider.engine.compiled import ONEDNN_MAX_ROWS, onednn_linear, onednn_rows, packed_linear
from outrider.engine.quant.weight import Int8Int8Linear, QuantizedWeight, kernel_for, stacked


@dataclass(frozen=True)
class TPGroup:
    """Where this process sits in its tensor-parallel group (tp=1: no group at all)."""

    rank: int = 0
    size: int = 1
    group: object | None = None      # tensor collectives (NCCL on CUDA, gloo on CPU)
    cpu_group: object | None = None  # gloo: the driver's forward descriptions

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The least of every rank's `value` (a figure all ranks must agree on)."""
        if self.size == 1:
            return value
        least = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(least.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _rows(tensor_slice, start: int, end: int) -> torch.Tensor:
    return tensor_slice[start:end]


def _cols(tensor_slice, start: int, end: int) -> torch.Tensor:
    return tensor_slice[:, start:end]


def _full(tensor_slice) -> torch.Tensor:
    return tensor_slice[:]


def _check_shape(tensor_slice, expected: tuple[int, ...]) -> None:
    """Compare the checkpoint's full (unsharded) shape with what the config implies."""
    shape = tuple(tensor_slice.get_shape() if hasattr(tensor_slice, "get_shape")
                  else tensor_slice.shape)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {shape}, the config implies {expected}")


def _full_shape(param: nn.Parameter, dim: int, full: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if dim < len(shape):
        shape[dim] = full
    return tuple(shape)


def load_replicated(param: nn.Parameter, tensor_slice, shard_id=None) -> None:
    """Loader for parameters every rank holds whole (norms, replicated layers)."""
    _check_shape(tensor_slice, tuple(param.shape))
    param.data.copy_(_full(tensor_slice))


class PackedForCPU:
    """CPU matmuls with few rows (decode: 1, verification: 1+γ, a batch of them) are
    slow against the checkpoint's [out, in] layout. After loading, CPU layers keep their
    weight prepacked for oneDNN (its blocked layout: measured 1.1-1.7x faster than MKL's
    sgemm on [in, out] from 2 to 160 rows here; bf16 too, ~2x fp32's GEMM rate) and
    multiply with `x @ weight_t` on an [in, out] copy where oneDNN is missing. A single
    row through a small fp32 layer pays oneDNN's fixed cost (0.7x), so small fp32 layers
    keep the [in, out] copy for it too (PyTorch's bf16 single row is slower than
    oneDNN's, so bf16 never does)."""

    weight_packed: torch.Tensor | None = None
    weight_t: torch.Tensor | None = None
    quantized_matmul = None  # a quantized weight's CPU kernel (quant/weight.py)
    out_features: int = 0

    def pack_for_cpu(self) -> None:
        weight = self.weight.data
        self.out_features = weight.shape[0]
        if self.quantized_matmul is not None:
            return
        if _has_onednn_linear(weight.dtype):
            self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        if self.weight_packed is None or (weight.numel() <= SMALL_LAYER
                                          and weight.dtype == torch.float32):
            self.weight_t = weight.t().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, in] -> [num_rows, out]
        if self.quantized_matmul is not None:
            return self.quantized_matmul(x)
        if self.weight_packed is not None and (x.shape[0] > 1 or self.weight_t is None):
            return packed_linear(x, self.weight_packed, self.out_features)
        return x @ self.weight_t if self.weight_t is not None else F.linear(x, self.weight)


def prepare_cpu_linears(model: nn.Module, max_rows: int) -> None:
    """Multiply each oneDNN weight shape (prepacked dense, and int8 x int8) once at every
    row count oneDNN will see for forwards of up to `max_rows` rows (onednn_rows; larger
    ones run in pieces of ONEDNN_MAX_ROWS), so that a serving replica builds its primitives
    at start: its memory is then flat whatever the load, and no step pays for building one."""
    products = {}  # (kind, weight shape [out, in], input dtype) -> x [rows, in] -> output
    for m in model.modules():
        if isinstance(m, PackedForCPU) and m.weight_packed is not None:
            weight = m.weight_packed
            products["dense", tuple(weight.shape), weight.dtype] = functools.partial(
                onednn_linear, packed=weight)
        elif (isinstance(m, PackedForCPU) and isinstance(m.quantized_matmul, Int8Int8Linear)
              and not m.quantized_matmul.amx):  # AMX's kernel keeps no primitives
            # one primitive of int8 levels, whatever the inputs' dtype
            products["int8", m.quantized_matmul.shape, torch.float32] = m.quantized_matmul
    row_counts = sorted({onednn_rows(rows)
                         for rows in range(1, min(max_rows, ONEDNN_MAX_ROWS) + 1)})
    with torch.no_grad():
        for (_, (_, in_features), dtype), product in products.items():
            for rows in row_counts:
                product(torch.zeros(rows, in_features, dtype=dtype))

SMALL_LAYER = 1 << 20  # fp32 weights this small also keep an [in, out] copy for single rows
ONEDNN_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.1}  # the dtypes packed, and how
#                                                               near F.linear they must be


@functools.cache
def _has_onednn_linear(dtype: torch.dtype) -> bool:
    """Whether this torch can run prepacked oneDNN linears in `dtype` (and gets them
    right: a 3x5 check against F.linear, to the dtype's precision)."""
    if dtype not in ONEDNN_TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(5, 7).to(dtype), torch.randn(3, 7).to(dtype)
        out = onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, None))
        return bool(torch.allclose(out.float(), F.linear(x.float(), weight.float()),
                                   atol=ONEDNN_TOLERANCE[dtype]))
    except (AttributeError, RuntimeError):
        return False


_WEIGHTS_DEFERRED = contextvars.ContextVar("linear weights deferred", default=False)


@contextlib.contextmanager
def linear_weights_deferred(deferred: bool = True):
    """Linear layers built inside leave their dense weight unallocated (on the meta
    device) until a dense tensor is stored in it or a quantized one is dequantized into
    it; and a layer is settled (its kernel's form made) as soon as its parts are in. A
    quantized checkpoint then loads within its kernels' size plus a layer's unpacked
    levels, where allocating every dense weight first took the bf16 model's (a 70B
    model's 140 GB for its 35 GB of 4-bit levels)."""
    token = _WEIGHTS_DEFERRED.set(deferred)
    try:
        yield
    finally:
        _WEIGHTS_DEFERRED.reset(token)


class ReplicatedLinear(PackedForCPU, nn.Module):
    """A linear layer every rank holds whole (norms and small projections)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight_device = torch.get_default_device()  # where the weight is, or will be
        self.weight = nn.Parameter(torch.empty(
            out_features, in_features, device="meta" if _WEIGHTS_DEFERRED.get() else None),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized_parts: list[tuple[int, QuantizedWeight]] = []  # (first row, part)
        self.quantized_bits = 0  # a quantized checkpoint's weight bits, once settled

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard_id=None) -> None:
        _check_shape(tensor_slice, tuple(param.shape))
        self._store(param, 0, _full(tensor_slice))

    def _store(self, param: nn.Parameter, first_row: int, value) -> None:
        """This rank's rows `value` of `param` from `first_row` on (a quantized weight's
        part is kept until every part is in: settle_quantized)."""
        if isinstance(value, QuantizedWeight):
            self.quantized_parts.append((first_row, value))
            if sum(part.shape[0] for _, part in self.quantized_parts) == self.weight.shape[0]:
                self.settle_quantized()  # now: its unpacked levels go as the checkpoint is read
        else:
            param = self.allocated_weight() if param.is_meta else param
            param.data.narrow(0, first_row, value.shape[0]).copy_(value)

    def allocated_weight(self) -> nn.Parameter:
        """The dense weight, allocated now if it was deferred (linear_weights_deferred)."""
        if self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype,
                                                   device=self.weight_device),
                                       requires_grad=False)
        return self.weight

    def settle_quantized(self) -> None:
        """Once loaded: a quantized weight multiplied by a CPU or GPU kernel where one
        takes it, else dequantized into `weight` (a shape no kernel takes)."""
        if not self.quantized_parts:
            return
        weight = stacked(self.quantized_parts)
        self.quantized_parts, self.quantized_bits = [], weight.bits
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"quantized parts of {weight.shape[0]} rows for a layer of "
                             f"{self.weight.shape[0]}: a fused layer (q/k/v, gate/up) whose "
                             f"parts are not all quantized is not supported")
        device = self.weight_device
        self.quantized_matmul = kernel_for(weight, self.weight.dtype, device)
        if self.quantized_matmul is None:
            self.allocated_weight().data.copy_(weight.dequantized(self.weight.dtype))
        elif device.type != "cpu":
            self.weight = None  # only the quantized copy is read (a CPU's: pack_for_cpu)

    def pack_for_cpu(self) -> None:
        super().pack_for_cpu()
        self.weight = None  # only the packed copy is used from now on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across ranks; the output stays sharded (no collective)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features // tp.size, bias, tp)
        self.shard_size = out_features // tp.size

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard_id=None) -> None:
        _check_shape(tensor_slice, _full_shape(param, 0, self.shard_size * self.tp.size))
        start = self.tp.rank * self.shard_size
        self._store(param, 0, _rows(tensor_slice, start, start + self.shard_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul.

    `output_sizes` are the full (unsharded) sizes, in the order the shards are stacked.
    Checkpoint tensors name their part with `shard_id` (an index into output_sizes).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp)
        self.local_sizes = [size // tp.size for size in output_sizes]

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard_id=None) -> None:
        if shard_id is None:  # every part in one tensor, stacked (Phi-3's qkv_proj, gate_up_proj)
            self._load_stacked(param, tensor_slice)
            return
        offset = sum(self.local_sizes[:shard_id])
        local = self.local_sizes[shard_id]
        _check_shape(tensor_slice, _full_shape(param, 0, local * self.tp.size))
        start = self.tp.rank * local
        self._store(param, offset, _rows(tensor_slice, start, start + local))

    def _load_stacked(self, param: nn.Parameter, tensor_slice) -> None:
        full = [local * self.tp.size for local in self.local_sizes]
        _check_shape(tensor_slice, _full_shape(param, 0, sum(full)))
        for i, local in enumerate(self.local_sizes):
            start = sum(full[:i]) + self.tp.rank * local
            self._store(param, sum(self.local_sizes[:i]), _rows(tensor_slice, start,
                                                                 start + local))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections fused; heads are split across ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias, tp)


class RowParallelLinear(ReplicatedLinear):
    """Input features split across ranks; partial outputs are summed with all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features // tp.size, out_features, bias, tp)
        self.shard_size = in_features // tp.size

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard_id=None) -> None:
        if param is self.bias:
            load_replicated(param, tensor_slice)
            return
        _check_shape(tensor_slice, _full_shape(param, 1, self.shard_size * self.tp.size))
        start = self.tp.rank * self.shard_size
        self._store(param, 0, _cols(tensor_slice, start, start + self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.matmul(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank embeds the ids it owns."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard may be short
        self.vocab_start = tp.rank * self.shard_size
        self.vocab_end = min(vocab_size, self.vocab_start + self.shard_size)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard_id=None) -> None:
        _check_shape(tensor_slice, (self.vocab_size, param.shape[1]))
        rows = _rows(tensor_slice, self.vocab_start, self.vocab_end)
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackedForCPU, VocabParallelEmbedding):
    """Output projection split by vocabulary; logits are gathered to full width. With tied
    embeddings `weight` is the embedding's, so the CPU copy is an extra [hidden, vocab]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> logits [num_rows, vocab_size]
        logits = self.matmul(hidden)
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
