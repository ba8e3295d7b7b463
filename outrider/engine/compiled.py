"""The model's forward as one compiled graph (torch.compile, inductor: C++/OpenMP on CPU).

What a step of a small model costs on CPU is mostly fixed per-op cost: ~25 small ops per
layer, each a Python dispatch and a pass over memory. Inductor fuses the elementwise ops
(norms, RoPE, SiLU·up, residual adds) into a few C++ loops; two pieces stay opaque to it,
as custom ops it calls as they are:

- the CPU linears, prepacked for oneDNN (`PackedForCPU`): 2.3x the GEMM inductor would
  pick here (MKL's sgemm), measured in BENCHMARKS.md;
- paged attention over the ragged batch (`attention.py`): its grouping depends on the
  step's metadata (how many sequences, which are prefill chunks), which would otherwise
  recompile the graph; the metadata reaches it through `forward_metadata`, set by
  CompiledForward around each call (vLLM's piecewise scheme does the same).

The number of tokens in a forward is a dynamic dimension, so one graph serves decode,
verification (1+γ per sequence) and prefill chunks alike, with no padding: on a CPU a
padded row costs as much as a real one. Compiled code is cached on disk
(`TORCHINDUCTOR_CACHE_DIR`, default ~/.cache/outrider/inductor), so a restart reuses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.fx.experimental._config
import torch.nn.functional as F
from tqdm import tqdm

from outrider.engine.attention import AttentionMetadata, paged_attention

log = logging.getLogger(__name__)

_metadata: list[AttentionMetadata] = []  # the forward in progress (one at a time per rank)


@contextlib.contextmanager
def forward_metadata(meta: AttentionMetadata) -> Iterator[None]:
    _metadata.append(meta)
    try:
        yield
    finally:
        _metadata.pop()


@torch.library.custom_op("outrider::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, window: int,
                        scale: float, softcap: float) -> torch.Tensor:
    return paged_attention(q, k, v, k_cache, v_cache, _metadata[-1],
                           window if window > 0 else None, scale, softcap)


@_paged_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, window, scale, softcap):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata | None, window: int | None,
              scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Paged attention, called directly in eager mode (a custom op's dispatch costs
    ~10 µs a call) and as an opaque op inside a compiled graph, which is given no
    metadata (its guards would cost more than the step saves) and reads it from
    forward_metadata instead."""
    if meta is None:
        return _paged_attention_op(q, k, v, k_cache, v_cache, window or 0, scale, softcap)
    return paged_attention(q, k, v, k_cache, v_cache, meta, window, scale, softcap)


# oneDNN multiplies at most this many rows at once: a larger product (a prefill chunk, a
# wide verification) runs as even pieces of it, so every shape it ever builds is among the
# 96 a replica prepares at start whatever its batch budget. Preparing every row count up to
# 2,048 took 11-14 s on a 140M checkpoint (the vocabulary's head dominates, minutes for a
# 128k one), up to 512 rows ~4 s; the five linears of that checkpoint on one core, pieced
# against whole, best of 9: 195 / 196 ms at 640 rows, 894 / 871 at 2,048 (within noise)
ONEDNN_MAX_ROWS = 512


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ a weight prepacked by torch.ops.mkldnn._reorder_linear_weight."""
    return onednn_pieces(x, lambda rows: torch.ops.mkldnn._linear_pointwise(
        rows, packed, None, "none", [], ""))


def onednn_pieces(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor:
    """product(x) for x [rows, in] computed by oneDNN, in pieces of at most
    ONEDNN_MAX_ROWS rows, each multiplied as onednn_rows(rows) rows (zero rows after
    x's, their outputs dropped)."""
    rows = x.shape[0]
    if rows > ONEDNN_MAX_ROWS:  # even pieces: no small last one, which multiplies slowest
        pieces = -(-rows // ONEDNN_MAX_ROWS)
        return torch.cat([_padded_product(piece, product)
                          for piece in x.split(-(-rows // pieces))])
    return _padded_product(x, product)


def _padded_product(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    rows = x.shape[0]
    padded = onednn_rows(rows)
    if padded > rows:
        x = F.pad(x, (0, 0, 0, padded - rows))  # [padded, in]
    return product(x)[:rows]


def onednn_rows(rows: int) -> int:
    """How many rows oneDNN multiplies for `rows` (at most ONEDNN_MAX_ROWS): exact up to
    32, then rounded up to a 16th of their power of two (at most 6 % more, measured no
    slower up to 320 rows). oneDNN and PyTorch's ideep build and keep a primitive for every
    shape they see (~0.6 MB each here, 1,024 kept), and a server's steps see every row
    count up to its budget: a 64-stream soak grew the target's memory ~3 MB per new row
    count for minutes, and each first sight cost its step ~0.5 ms per layer shape. Rounded
    and pieced, any budget has 96 row counts, which a replica prepares at start
    (parallel.prepare_cpu_linears)."""
    step = 1 << max(0, rows.bit_length() - 5)
    return -(-rows // step) * step


@torch.library.custom_op("outrider::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return onednn_linear(x, packed)


@_packed_linear_op.register_fake
def _(x, packed, out_features):
    return x.new_empty(x.shape[0], out_features)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [rows, in] @ a oneDNN-prepacked weight -> [rows, out_features]."""
    if torch.compiler.is_compiling():
        return _packed_linear_op(x, packed, out_features)
    return onednn_linear(x, packed)


def _use_inductor_cache_dir() -> None:
    """Compiled code kept across restarts, in $TORCHINDUCTOR_CACHE_DIR if set."""
    path = Path(os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "outrider" / "inductor")))
    path.mkdir(parents=True, exist_ok=True)


def _compile_in_process_on_few_cores() -> None:
    """On at most two cores, the compiler's pool of worker processes (each importing
    torch) costs more than compiling in turn: a cold compile of the test target took
    61-62 CPU s with the pool and 47-49 without (52-54 s -> 47-49 s on 2 cores).
    $TORCHINDUCTOR_COMPILE_THREADS, when set, decides."""
    import torch._inductor.config as inductor_config

    if len(os.sched_getaffinity(0)) <= 2 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        inductor_config.compile_threads = 1


# The shapes of forwards a model sees: (new tokens, logits rows). One token and one
# logits row are specialised by the compiler (its 0/1 rule), so each gets a graph of its
# own; every larger count shares the dynamic one. Warming these up compiles them all.
WARM_UP_SHAPES = ((1, 1), (3, 1), (3, 3), (3, 0), (1, 0))


class CompiledForward:
    """A model's forward compiled once for every number of tokens, after a bounded
    warm-up; eager if compiling fails (one log line says why), so a replica always
    serves."""

    def __init__(self, model: torch.nn.Module, label: str) -> None:
        _use_inductor_cache_dir()
        _compile_in_process_on_few_cores()
        # duck sizing would tie the token count to any weight dimension it happened to
        # equal (4096 tokens to a 4096 vocabulary) and recompile when they part
        torch.fx.experimental._config.use_duck_shape = False
        self.label = label
        self.eager: Callable = model.forward
        self.compiled: Callable | None = torch.compile(_own_code(model.forward), dynamic=True,
                                                       fullgraph=True)
        self.failure = ""

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            try:  # the graph gets no metadata: paged attention reads forward_metadata's
                with forward_metadata(meta):
                    return self.compiled(input_ids, positions, kv_caches, None, logits_rows)
            except (torch._dynamo.exc.TorchDynamoException,
                    torch._inductor.exc.InductorError) as exc:
                self.fall_back(exc)
        return self.eager(input_ids, positions, kv_caches, meta, logits_rows)

    def fall_back(self, exc: BaseException) -> None:
        self.compiled = None
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failure = f"{type(exc).__name__}: {first_line}"
        log.warning("%s: compiling the forward failed, serving eagerly (%s)", self.label,
                    self.failure)

    def warm_up(self, run: Callable[[int, int], None]) -> float:
        """Compile every graph before traffic needs it: `run(tokens, logits_rows)` runs
        one forward of that shape. Returns the seconds it took."""
        start = time.perf_counter()
        with tqdm(WARM_UP_SHAPES, desc=f"compiling {self.label}", unit="graph",
                  disable=None, leave=False) as shapes:
            for tokens, rows in shapes:
                if self.compiled is None:
                    break
                run(tokens, rows)
        seconds = time.perf_counter() - start
        log.info("%s: forward %s in %.1f s", self.label,
                 "compiled" if self.compiled else "eager", seconds)
        return seconds


def _own_code(method: Callable) -> Callable:
    """`method` with a code object of its own: the compiler keeps its graphs per code
    object, and a target and a draft model in one process must not share (and evict)
    each other's."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                              func.__defaults__, func.__closure__)
    return types.MethodType(copy, method.__self__)
