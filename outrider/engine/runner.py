"""Model runner: one rank's weights and KV memory, and the forward over a ragged batch.

The driver (rank 0) decides everything — which sequences, which KV blocks — and hands
each forward to the other ranks of its tensor-parallel group as a flat int64 tensor
(`encode_requests`), so every rank runs the same forward. No Python objects cross
process boundaries.
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from outrider.core.hf_config import checkpoint_name
from outrider.core.stats import MODEL_METHOD
from outrider.engine.attention import (
    AttentionMetadata,
    SequenceSlice,
    gpu_kernel_fits,
    kv_cache_shapes,
    slots_of,
)
from outrider.engine.block_manager import BlockManager
from outrider.engine.compiled import CompiledForward
from outrider.engine.cuda_graphs import SIZES as GRAPH_SIZES
from outrider.engine.cuda_graphs import GraphedSteps
from outrider.engine.features import FeatureTap
from outrider.engine.kernels.triton_paged import runs_here
from outrider.engine.memory import kv_budget_from_memory
from outrider.engine.model import CausalLM
from outrider.engine.model_config import ModelConfig, ModelConfigError, parse_dtype
from outrider.engine.parallel import (
    PackedForCPU,
    TPGroup,
    linear_weights_deferred,
    prepare_cpu_linears,
)

log = logging.getLogger(__name__)


SMALL_STEP_TOKENS = 16  # a forward of fewer tokens is small (RunnerConfig.small_step_threads)
# ... and of a model of at most this many bytes of weights a rank (in its dtype: a quantized
# one's kernels do the dense arithmetic): a larger one streams its weights from memory at
# every step, and a second core brings bandwidth and arithmetic (a ~140M-parameter
# fp32 Llama's decode step: 65 ms on one thread, 38 on two; the demo target's 40 MB, held
# in the last-level cache: 6.7 against 4.8 ms alone, but served one thread does better)
SMALL_STEP_WEIGHT_BYTES = 128 << 20
STEP_THREADS = ("by-kind", "by-size")  # RunnerConfig.step_threads
ACTIVATION_TOKENS = 8192  # tokens of the largest forward a budget from memory leaves room for
LOGITS_ROWS = 1024        # logits rows of that forward


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "auto"        # auto: the checkpoint's, where the device computes it (_auto_dtype)
    tp: int = 1
    block_size: int = 16
    kv_cache_mb: float | None = 256.0  # KV budget per rank; None: from memory (_kv_budget)
    memory_utilization: float | None = None  # what the budget from memory may take:
    #                           the share of a GPU the process may take, weights included
    #                           (default 0.9), or of a CPU machine's RAM the KV cache
    #                           takes (default 0.1: replicas share the machine)
    max_num_seqs: int = 256     # CPU: the budget from memory holds at most this many
    #                             sequences of max_model_len
    max_model_len: int | None = None  # None: the model's context, at most
    #                                  DEFAULT_MAX_MODEL_LEN; given: checked at start
    #                                  against the model's context and the KV cache
    threads: int = 0            # CPU threads per rank; 0: the cores shared out over tp
    small_step_threads: int = 0  # CPU threads of a small forward (step_threads); 0: all
    step_threads: str = "by-kind"  # small: fewer than SMALL_STEP_TOKENS tokens, and with
    #                               "by-kind" a decode step (one token a sequence)
    prefix_caching: bool = True  # share the KV of common prefixes (block_manager.py)
    compile: bool = False       # the forward as one compiled graph (compiled.py); off:
    #                             it measured no faster on CPU (BENCHMARKS.md)
    enforce_eager: bool = False  # CUDA: every step eager; else steps of short queries
    #                             replay CUDA graphs captured at start (cuda_graphs.py)
    prepared_rows: int = 0      # CPU: the linears prepared at start for every forward
    #                             of up to this many tokens (serving replicas; 0: none)
    quantization: str | None = None  # vLLM's --quantization: "fp8" quantizes an
    #                                  unquantized checkpoint's linears as they load
    feature_width: int = 0      # a draft head's features a position (FeatureTap.width),
    #                             kept beside each block's KV so its prefix cache serves
    #                             the head too; carved from the KV budget (0: none)

    def __post_init__(self) -> None:
        given = [v for v in (self.kv_cache_mb, self.max_model_len) if v is not None]
        if self.block_size < 1 or self.max_num_seqs < 1 or any(v <= 0 for v in given):
            raise ValueError("block_size, kv_cache_mb, max_model_len and max_num_seqs must be "
                             "positive")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got "
                             f"{self.memory_utilization}")
        if self.step_threads not in STEP_THREADS:
            raise ValueError(f"step_threads must be one of {', '.join(STEP_THREADS)}, got "
                             f"{self.step_threads!r}")
        if self.prepared_rows < 0 or self.small_step_threads < 0:
            raise ValueError("prepared_rows and small_step_threads must be >= 0")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass
class ForwardRequest:
    """One sequence's part of a forward: new tokens after `cached_len` cached positions."""

    token_ids: list[int]
    cached_len: int
    block_table: list[int]
    num_logits: int  # logits wanted for the last `num_logits` new positions
    features: torch.Tensor | None = None  # a head's: [len(token_ids), width] (heads.py)
    # a token tree's (engine/tree.py `row_tree`): each new position's offset from
    # cached_len and its attention mask; None: a chain, offsets 0, 1, 2, ...
    tree: tuple[list[int], list[int]] | None = None


class ModelRunner:
    method = MODEL_METHOD  # what its proposals count as when it drafts (core/stats.py)

    def __init__(self, cfg: RunnerConfig, tp: TPGroup | None = None) -> None:
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.model_config = self.read_model_config()
        self.model_config.check_tp(cfg.tp)
        if cfg.tp != self.tp.size:
            raise ModelConfigError(f"tp={cfg.tp} but the process group has {self.tp.size} ranks")
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" (--device auto's) named: set_device refuses a device without an
            # index, and the kernels' probes are kept per device
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            # cuDNN's SDPA builds an execution plan per shape, and a ragged batch's shapes
            # change every step: 5-9 ms of CPU a call on an H100 in bfloat16 (10x the
            # step); the flash and memory-efficient kernels take any shape as it comes
            torch.backends.cuda.enable_cudnn_sdp(False)
            # Triton launches, and a CUDA graph captures, on the current device
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg, self.model_config)
        self.max_model_len = context_limit(cfg, self.model_config)
        self.model = self.served(self.build_model())
        if self.model_config.quantization is not None:
            log_quantized(self.model_name, self.model, self.model_config.quantization,
                          self.dtype)
        if self.device.type == "cpu" and cfg.prepared_rows:
            prepare_cpu_linears(self.model, cfg.prepared_rows)
        self._try_gpu_kernel()
        self.kv_caches, num_blocks = self._allocate_kv()
        self._check_fits(num_blocks)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_caching)
        self.warm_up_s = 0.0  # compiling the forward at start
        self.graph_capture_s = 0.0  # capturing its CUDA graphs at start
        self.threads = torch.get_num_threads()  # this rank's share (set_cpu_threads)
        self._set_step()

    def read_model_config(self) -> ModelConfig:
        return ModelConfig.from_dir(self.cfg.model_dir, self.cfg.quantization)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def keep_features(self, tap: FeatureTap) -> None:
        """Keep `tap`'s hidden states of every position each forward processes
        (`features`); the forward runs eagerly from now on. A feature cache of another
        width (RunnerConfig.feature_width) is not used: prefixes are not shared then."""
        self.model.tap = tap
        if self.feature_cache is not None and \
                self.feature_cache.shape[1] != tap.width(self.model_config.hidden_size):
            log.warning("feature cache %d wide, the head reads %d: prefixes not shared",
                        self.feature_cache.shape[1], tap.width(self.model_config.hidden_size))
            self.feature_cache = None
        self._set_step()

    def feature_slots(self, seq_id, start: int, num_positions: int) -> list[int]:
        """The feature cache's rows of `seq_id`'s positions start, start + 1, ... (its
        KV slots)."""
        return slots_of(self.blocks.block_table(seq_id), start, start + num_positions,
                        self.cfg.block_size)

    def store_features(self, slots: list[int], rows: torch.Tensor) -> None:
        """Features of positions ([len(slots), width]) beside their KV, where a sequence
        sharing the block finds them (feature_width); one write a step."""
        if self.feature_cache is not None and slots:
            self.feature_cache[torch.tensor(slots, device=self.device)] = rows

    def cached_features(self, seq_id, start: int, num_positions: int) -> torch.Tensor:
        """[num_positions, width]: the features of its positions start, start + 1, ...
        (a cached prefix's, or any committed ones': the loop stores them all)."""
        slots = self.feature_slots(seq_id, start, num_positions)
        return self.feature_cache[torch.tensor(slots, device=self.device)]

    @property
    def features(self) -> torch.Tensor | None:
        """The last forward's kept hidden states, [num_tokens, width] (the driver's)."""
        return self.model.features

    @property
    def model_name(self) -> str:
        """The checkpoint folder's name (how replicas name their model pair)."""
        return checkpoint_name(self.cfg.model_dir)

    def build_model(self, state: dict[str, torch.Tensor] | None = None) -> CausalLM:
        """This rank's model with the checkpoint's weights (or `state`'s), as plain
        modules: what serving prepacks, and what training trains."""
        quantized = state is None and self.model_config.quantization is not None
        with linear_weights_deferred(quantized):
            model = built_as(self.dtype, self.device, self.new_model)
        if state is None:
            model.load_weights(Path(self.cfg.model_dir))
        else:
            model.load_state_dict(state)
        return model

    def new_model(self) -> torch.nn.Module:
        """This rank's model, its weights not loaded yet."""
        return CausalLM(self.model_config, self.tp, self.max_model_len)

    def served(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` as this runner serves it: eval mode, CPU linears prepacked; on a GPU
        the memory freed while loading handed back to the device (the KV cache is sized
        from what is left)."""
        if self.device.type == "cpu":
            for module in model.modules():
                if isinstance(module, PackedForCPU):
                    module.pack_for_cpu()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
        return model.eval()

    def swap_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Serve new weights for the same model (an adopted draft version). The caller
        makes sure no forward runs meanwhile and drops KV computed with the old ones."""
        with torch.no_grad():
            self.model = self.served(self.build_model(state))
            self._set_step()

    def _set_step(self) -> None:
        """What a forward calls: the compiled forward, warmed up; the model itself with
        --no-compile and under tensor parallelism (its collectives have not been tried
        inside a compiled graph)."""
        self.step: CompiledForward | CausalLM = self.model
        self.graphs: GraphedSteps | None = None  # (captured after the compiler's warm-up)
        plain = self.tp.size == 1 and getattr(self.model, "tap", None) is None
        # (a draft head's forward reads the target's hidden states: eager)
        graphable = plain and isinstance(self.model, CausalLM)
        if self.cfg.compile and plain:
            self.step = CompiledForward(self.model, self.model_name)
            self.warm_up_s = self.step.warm_up(self._scratch_forward)
        if (self.device.type == "cuda" and not self.cfg.enforce_eager and graphable
                and gpu_kernel_fits(self.cfg.block_size)):
            self.graphs = GraphedSteps(self.step, self.kv_caches, self.cfg.block_size,
                                       -(-self.max_model_len // self.cfg.block_size),
                                       self.device)
            try:
                self.graph_capture_s = self.graphs.capture_all()
            except Exception as exc:  # noqa: BLE001 (a forward that syncs with the host, ...)
                log.warning("%s: capturing CUDA graphs failed, every step eager (%s)",
                            self.model_name, str(exc).strip().splitlines()[0])
                self.graphs = None

    def _scratch_forward(self, num_tokens: int, num_logits: int) -> None:
        """One forward of a throwaway sequence (its KV is freed at once)."""
        seq_id = ("warm-up", num_tokens, num_logits)
        self.blocks.append(seq_id, num_tokens)
        try:
            self.forward([ForwardRequest([1] * num_tokens, 0, self.blocks.block_table(seq_id),
                                         num_logits)])
        finally:
            self.blocks.free(seq_id)

    def _try_gpu_kernel(self) -> None:
        """On a GPU, whether the Triton attention kernel runs for this model (else the
        reference path, and no CUDA graphs: triton_paged.runs_here)."""
        if self.device.type == "cuda" and gpu_kernel_fits(self.cfg.block_size):
            mc = self.model_config
            runs_here(self.device, self.dtype, mc.num_heads // self.tp.size,
                      mc.num_kv_heads // self.tp.size, mc.head_dim, self.cfg.block_size)

    def _check_fits(self, num_blocks: int) -> None:
        """A --max-model-len given must fit one sequence in the KV cache, as vLLM checks
        at start (left unset, a sequence is capped by the cache: SpeculativeDecoder)."""
        wanted, block = self.cfg.max_model_len, self.cfg.block_size
        if wanted is None or num_blocks * block >= wanted:
            return
        needed_mb = -(-wanted // block) * self.kv_cache_mb / num_blocks
        budget = (f"--kv-cache-mb {self.kv_cache_mb:g}" if self.cfg.kv_cache_mb is not None
                  else f"the {self.kv_cache_mb:.0f} MiB free memory left it")
        raise ModelConfigError(
            f"--max-model-len {wanted} does not fit the KV cache: {budget} holds "
            f"{num_blocks * block} tokens; give --kv-cache-mb {needed_mb:.0f} or more"
            f"{' (or a larger --gpu-memory-utilization)' if self.cfg.kv_cache_mb is None else ''}"
            f", or a --max-model-len of at most {num_blocks * block}")

    def _allocate_kv(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        mc = self.model_config
        kv_heads = mc.num_kv_heads // self.tp.size
        keeps_features = self.cfg.prefix_caching and self.cfg.feature_width
        feature_bytes = self.cfg.feature_width * self.dtype.itemsize if keeps_features else 0
        slot_bytes = 2 * mc.num_layers * kv_heads * mc.head_dim * self.dtype.itemsize \
            + feature_bytes  # (every rank counts them: they agree on the blocks)
        budget = self._kv_budget(slot_bytes)
        self.kv_cache_mb = budget / 2**20  # per rank, as given or as sized from memory
        num_blocks = budget // (slot_bytes * self.cfg.block_size)
        if num_blocks < 1:
            raise ModelConfigError(
                f"a KV cache of {self.kv_cache_mb:.1f} MiB holds no KV block "
                f"({slot_bytes * self.cfg.block_size} bytes each)"
                + ("" if self.cfg.kv_cache_mb is not None else
                   ": free memory is short; give --kv-cache-mb or a larger "
                   "--gpu-memory-utilization"))
        shapes = kv_cache_shapes(num_blocks, self.cfg.block_size, kv_heads, mc.head_dim)
        # one tensor per layer and kind, not views of one: a compiled graph that writes
        # into a view copies its whole base (measured: 0.7 s a forward at 256 MB)
        def layer_cache(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        # [slots, feature_width]: the features of each cached position (the driver's)
        self.feature_cache = (layer_cache((num_blocks * self.cfg.block_size,
                                           self.cfg.feature_width))
                              if keeps_features and self.tp.is_driver else None)
        return [tuple(map(layer_cache, shapes)) for _ in range(mc.num_layers)], num_blocks

    def _kv_budget(self, slot_bytes: int) -> int:
        """Bytes of KV cache per rank: --kv-cache-mb, or what memory leaves (memory.py),
        the same on every rank (the driver's block tables index all of them)."""
        if self.cfg.kv_cache_mb is not None:
            return int(self.cfg.kv_cache_mb * 2**20)
        full_batch = slot_bytes * self.cfg.max_num_seqs * self.max_model_len
        budget = kv_budget_from_memory(self.device, self.cfg.memory_utilization,
                                       self._activation_bytes(), full_batch)
        return self.tp.min_over_ranks(budget)

    def _activation_bytes(self) -> int:
        """What one large forward needs beside weights and KV (a GPU's budget keeps it
        free): its hidden states and MLP activations, and fp32 logits."""
        mc = self.model_config
        per_token = (3 * mc.intermediate_size // self.tp.size + 6 * mc.hidden_size)
        graphed = self.device.type == "cuda" and not self.cfg.enforce_eager
        logits_rows = LOGITS_ROWS + (GRAPH_SIZES[-1] if graphed else 0)  # (their logits)
        return (ACTIVATION_TOKENS * per_token * self.dtype.itemsize
                + logits_rows * mc.vocab_size * 4)

    @torch.inference_mode()
    def forward(self, requests: list[ForwardRequest], beside_draft: bool = False
                ) -> torch.Tensor:
        """Run one forward; returns logits [sum(num_logits), vocab] in fp32.
        `beside_draft`: a draft works meanwhile on the cores beyond this rank's own."""
        if not requests:
            return torch.zeros(0, self.vocab_size, device=self.device)
        if self.tp.size > 1 and self.tp.is_driver:
            broadcast_requests(self.tp, encode_requests(requests))
        return self._forward(requests, beside_draft)

    def _forward(self, requests: list[ForwardRequest], beside_draft: bool = False
                 ) -> torch.Tensor:
        if self.graphs is not None and (size := self.graphs.size_for(requests)):
            return self.graphs(requests, size)
        self._use_threads(requests, beside_draft)
        input_ids, positions, meta, logits_rows = self._batch(requests)
        return self.step(input_ids, positions, self.kv_caches, meta, logits_rows)

    def _batch(self, requests: list[ForwardRequest]):
        """(input_ids, positions, metadata, logits rows) of a forward over `requests`."""
        device = self.device
        input_ids, positions, logits_rows, offset = [], [], [], 0
        for r in requests:
            n = len(r.token_ids)
            input_ids.extend(r.token_ids)
            offsets = range(n) if r.tree is None else r.tree[0]
            positions.extend(r.cached_len + o for o in offsets)
            logits_rows.extend(range(offset + n - r.num_logits, offset + n))
            offset += n
        meta = AttentionMetadata.build(
            [SequenceSlice(r.cached_len, len(r.token_ids), r.block_table,
                           None if r.tree is None else r.tree[1]) for r in requests],
            self.cfg.block_size, device)
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return as_long(input_ids), as_long(positions), meta, as_long(logits_rows)

    def move_kv(self, block_table: list[int], moves: list[tuple[int, int]]) -> None:
        """Copy the KV at position src to position dst for each (src, dst) of one sequence,
        in every layer (a token tree's accepted path, packed after the committed tokens);
        every tensor-parallel rank does the same."""
        if not moves:
            return
        bs = self.cfg.block_size
        slots = [[block_table[p // bs] * bs + p % bs for p in ends] for ends in zip(*moves)]
        if self.tp.size > 1 and self.tp.is_driver:
            broadcast_requests(self.tp, torch.tensor([MOVE_KV, len(moves), *slots[0],
                                                      *slots[1]], dtype=torch.long))
        self._move_slots(*slots)

    def _move_slots(self, src: list[int], dst: list[int]) -> None:
        bs = self.cfg.block_size
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for keys, values in self.kv_caches:  # keys [blocks, kv_heads, dim, bs]
            keys[dst_t // bs, :, :, dst_t % bs] = keys[src_t // bs, :, :, src_t % bs]
            values[dst_t] = values[src_t]  # [slots, kv_heads, dim]

    @functools.cached_property
    def weight_bytes(self) -> int:
        """This rank's share of the model's weights in its dtype, in bytes (from its
        shapes: CPU layers keep theirs prepacked, outside the module's parameters), the
        quantized ones counted as dense: the work of a step's linears, which an int4 or
        int8 kernel does in the model's dtype from what it unpacks (docs/DESIGN.md §10.1)."""
        return self.model_config.num_params * self.dtype.itemsize // self.tp.size

    @functools.cached_property
    def bytes_saved_by_quantization(self) -> int:
        """What this rank's quantized layers multiplied packed read less than in its dtype."""
        kernels = [m.quantized_matmul for m in self.model.modules()
                   if getattr(m, "quantized_matmul", None) is not None]
        return sum(k.numel * self.dtype.itemsize - k.nbytes for k in kernels)

    def _use_threads(self, requests: list[ForwardRequest], beside_draft: bool) -> None:
        """A small forward on `small_step_threads`, any other on every thread of this
        rank. Small: one with a draft working beside it (a speculation cache's stand-ins:
        the other cores are the draft's then), fewer than
        SMALL_STEP_TOKENS tokens, and (step_threads "by-kind") a
        decode step, one token a sequence, whatever the batch: serving, such a step
        streams a delta per token to the router, which keeps the other cores busy, and a
        forward there waits at every parallel region for its preempted threads (a
        32-stream decode step took 9.7 ms on two threads, 7.5 on one: BENCHMARKS §1),
        while a verification's or a prefill's larger forward gains from them. Every rank
        runs the same forward, so they switch alike. A model of more than
        SMALL_STEP_WEIGHT_BYTES a rank has no small forwards."""
        if self.device.type != "cpu" or not self.cfg.small_step_threads:
            return
        decode = self.cfg.step_threads == "by-kind" and all(len(r.token_ids) == 1
                                                             for r in requests)
        small = ((beside_draft or decode
                  or sum(len(r.token_ids) for r in requests) < SMALL_STEP_TOKENS)
                 and self.weight_bytes <= SMALL_STEP_WEIGHT_BYTES)
        threads = min(self.cfg.small_step_threads, self.threads) if small else self.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def serve_driver(self) -> None:
        """Non-driver ranks: run every forward the driver broadcasts until told to stop."""
        while (requests := receive_requests(self.tp)) is not None:
            with torch.inference_mode():
                try:
                    if isinstance(requests, tuple):  # KV moves (move_kv)
                        self._move_slots(*requests)
                    else:
                        self._forward(requests)
                except Exception as exc:  # the driver sees the same failure and reports it
                    print(f"tp rank {self.tp.rank}: forward failed: {exc}", file=sys.stderr,
                          flush=True)

    def stop_workers(self) -> None:
        if self.tp.size > 1 and self.tp.is_driver:
            broadcast_requests(self.tp, torch.tensor([-1], dtype=torch.long))


def built_as(dtype: torch.dtype, device: torch.device, make) -> torch.nn.Module:
    """`make()`'s module with its parameters created in `dtype` on `device`."""
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(torch.float32)


DEFAULT_MAX_MODEL_LEN = 8192  # a model's context beyond this needs --max-model-len


def context_limit(cfg: RunnerConfig, mc: ModelConfig) -> int:
    """The longest sequence this runner serves: --max-model-len, never past the model's."""
    if cfg.max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, mc.max_position_embeddings)
    if cfg.max_model_len > mc.max_position_embeddings:
        raise ModelConfigError(f"--max-model-len {cfg.max_model_len} exceeds the model's "
                               f"context of {mc.max_position_embeddings} tokens")
    return cfg.max_model_len


def log_quantized(name: str, model: torch.nn.Module, scheme, dtype: torch.dtype) -> None:
    """How a quantized checkpoint's linears run: which packed kernel, or dequantized (in
    float32, say, where no kernel is fast: quant/weight.cpu_kernel)."""
    kinds = collections.Counter(
        type(m.quantized_matmul).__name__ if m.quantized_matmul is not None
        else f"dense {str(dtype).removeprefix('torch.')}"
        for m in model.modules() if getattr(m, "quantized_bits", 0))
    log.info("%s: quantized (%s), linears: %s", name, scheme.description,
             ", ".join(f"{n} {kind}" for kind, n in kinds.items()) or "dequantized at load")


def resolve_dtype(cfg: RunnerConfig, mc: ModelConfig) -> torch.dtype:
    if cfg.dtype != "auto":
        return parse_dtype(cfg.dtype)
    dtype = _auto_dtype(cfg.device, mc.dtype)
    log.info("%s: --dtype auto is %s (checkpoint %s, device %s)", Path(cfg.model_dir).name,
             str(dtype).removeprefix("torch."), str(mc.dtype).removeprefix("torch."),
             cfg.device)
    return dtype


def _auto_dtype(device: str, checkpoint: torch.dtype) -> torch.dtype:
    """The checkpoint's dtype where the device computes it natively: always on CUDA; on
    CPU a half-precision checkpoint runs in bfloat16 where the CPU has bfloat16
    instructions (AVX512-BF16 or AMX), as vLLM's `auto` does, and in float32 elsewhere
    (emulated bfloat16 matmuls are slower than float32 ones)."""
    if device.startswith("cuda") or checkpoint == torch.float32:
        return checkpoint
    return torch.bfloat16 if cpu_computes_bfloat16() else torch.float32


def cpu_computes_bfloat16() -> bool:
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


# -- driver -> worker forward descriptions (flat int64, no pickling) ------------------------

MOVE_KV = -2  # a broadcast that moves KV (move_kv) instead of running a forward


def encode_requests(requests: list[ForwardRequest]) -> torch.Tensor:
    flat = [len(requests)]
    for r in requests:
        flat += [len(r.token_ids), r.cached_len, len(r.block_table), r.num_logits,
                 r.tree is not None]
        flat += r.token_ids + r.block_table + ([] if r.tree is None else r.tree[0] + r.tree[1])
    return torch.tensor(flat, dtype=torch.long)


def decode_requests(flat: list[int]) -> list[ForwardRequest] | tuple[list[int], list[int]]:
    if flat[0] == MOVE_KV:
        n = flat[1]
        return flat[2:2 + n], flat[2 + n:2 + 2 * n]
    requests, i = [], 1
    for _ in range(flat[0]):
        n, cached, num_blocks, num_logits, is_tree = flat[i:i + 5]
        i += 5
        tokens, table = flat[i:i + n], flat[i + n:i + n + num_blocks]
        i += n + num_blocks
        tree = None
        if is_tree:
            tree, i = (flat[i:i + n], flat[i + n:i + 2 * n]), i + 2 * n
        requests.append(ForwardRequest(tokens, cached, table, num_logits, tree=tree))
    return requests


def broadcast_requests(tp: TPGroup, payload: torch.Tensor) -> None:
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.long), 0, group=tp.cpu_group)
    dist.broadcast(payload, 0, group=tp.cpu_group)


def receive_requests(tp: TPGroup) -> list[ForwardRequest] | tuple | None:
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, 0, group=tp.cpu_group)
    payload = torch.empty(int(size), dtype=torch.long)
    dist.broadcast(payload, 0, group=tp.cpu_group)
    flat = payload.tolist()
    return None if flat == [-1] else decode_requests(flat)
