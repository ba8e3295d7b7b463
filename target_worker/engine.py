"""The target replica's engine loop: one thread runs steps for the whole batch; gRPC
handlers submit requests, and each request's chunks go to its sink — a queue of its own
(a Generate stream), or the Serve stream of the router that sent it, which takes a
whole step's chunks as one message: sinks are flushed once per step.

Every step the γ policy (outrider/core/policy.py) chooses γ for each sequence from the batch
heat, the sequence's acceptance estimate and the replica's measured cost model; the
scheduler then plans the step with those γ. Tensor-parallel ranks follow rank 0's
forwards, so the decision reaches them with the tokens."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from outrider.target_worker.scheduler import Scheduler, SchedulerConfig

from outrider.core.load import ReplicaLoad, model_pair
from outrider.core.policy import Acceptance, GammaPolicy, OnlineCost, RequestState, SpecMode
from outrider.core.sampling import SamplingParams, TokenLogprob
from outrider.core.sequence import FinishReason, ProposerKind, Round, RoundStats, Sequence
from outrider.core.stats import model_part
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.telemetry.metrics import TargetMetrics


@dataclass
class Chunk:
    """What one step committed for one request."""

    token_ids: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # None: the request runs on
    error: str = ""  # what failed it, when finish_reason is ERROR
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for
    num_cached_tokens: int = 0  # context positions the prefix cache held at admission


class ChunkSink(Protocol):
    """Where a request's chunks go."""

    def deliver(self, handle: Handle, chunk: Chunk) -> None: ...

    def flush(self) -> None:
        """The step is over: what it delivered may go out together."""


class ChunkQueue:
    """One request's chunks, in a queue its own reader drains."""

    def __init__(self) -> None:
        self.chunks: queue.Queue[Chunk] = queue.Queue()

    def deliver(self, handle: Handle, chunk: Chunk) -> None:
        self.chunks.put(chunk)

    def flush(self) -> None:
        pass


@dataclass
class Handle:
    request_id: str
    seq: Sequence
    spec: RequestState  # mode, γ cap, acceptance estimate
    sink: ChunkSink = field(default_factory=ChunkQueue)
    is_cancelled: bool = False
    gamma_limit: int = 0  # FIXED: γ; AUTO: γ_max


def _no_warming_while_off(seqs: list, states: list[RequestState], gammas: list[int]) -> None:
    """An AUTO request's γ at its prefill step has the draft take in its whole prompt
    meanwhile, which the step waits for: worth it where the batch speculates, waste
    where the policy left every AUTO request already decoding at γ 0 (one with a fresh
    prior may still look worth it). Those newcomers then start plain, and the draft
    takes their context in at their first drafted round. Served at T 0.7 AUTO's TTFT was
    twice speculation off's at every load, 0.73x its tok/s at 64 streams."""
    decoding = [i for i, seq in enumerate(seqs) if seq.num_output and
                states[i].mode is SpecMode.AUTO]
    if not decoding or any(gammas[i] for i in decoding):
        return
    for i, seq in enumerate(seqs):
        if not seq.num_output and states[i].mode is SpecMode.AUTO:
            gammas[i] = 0


class TargetEngine:
    def __init__(self, decoder: SpeculativeDecoder, sched_cfg: SchedulerConfig,
                 policy: GammaPolicy, metrics: TargetMetrics | None = None) -> None:
        self.decoder = decoder
        self.metrics = metrics
        self.scheduler = Scheduler(sched_cfg, decoder.target.blocks, decoder.admit, self._preempt)
        self.policy = policy
        self.cost = OnlineCost(policy.cost)  # the policy's model, kept true by every step
        # what the replica has seen, for requests that bring no acceptance estimate, by
        # (constrained, acceptance class): acceptance_for
        self._acceptance: dict[tuple[bool, str], Acceptance] = {}
        self._inbox: queue.Queue[Handle] = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._by_seq: dict[int, Handle] = {}
        self._cached_at_arrival: dict[int, int] = {}  # prompt positions cached when it came
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._touched: set = set()  # sinks delivered to since the last flush
        self.heat = 0.0
        self.tokens_per_s = 0.0
        self._stepped: int | None = None  # tokens the loop's last step committed
        self.broken = ""  # why the replica can no longer run steps (a TP rank is gone)

    @property
    def model_pair(self) -> str:
        drafter = self.decoder.drafter
        return model_pair(self.decoder.target.model_name,
                          drafter.model_name if drafter else "", drafter.version if drafter else 0)

    # -- called from gRPC threads ---------------------------------------------------------
    def submit(self, handle: Handle) -> None:
        with self._lock:
            if handle.request_id in self._handles:
                raise ValueError(f"request_id {handle.request_id!r} is already running")
            self._handles[handle.request_id] = handle
        self._inbox.put(handle)
        self._wake.set()

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            handle = self._handles.get(request_id)
        if handle is None:
            return False
        handle.is_cancelled = True
        self._wake.set()
        return True

    # -- the loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        if self.metrics:
            self.metrics.watch_engine_thread()
        while not stop.is_set() and not self.broken:
            start, self._stepped = time.perf_counter(), None
            self._admit_new()
            self._drop_cancelled()
            has_stepped = self.scheduler.has_work and self._timed_step()
            self._flush()
            if self._stepped is not None:  # the whole turn, deliveries included
                self.policy.observe_step(self._stepped, time.perf_counter() - start)
            if not has_stepped:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
        self._admit_new()
        for handle in list(self._by_seq.values()):  # nobody is left to serve them
            self._finish(handle, FinishReason.ERROR,
                         self.broken or "the replica is shutting down")
        self._flush()

    def _deliver(self, handle: Handle, chunk: Chunk) -> None:
        handle.sink.deliver(handle, chunk)
        self._touched.add(handle.sink)

    def _flush(self) -> None:
        for sink in self._touched:
            sink.flush()
        self._touched.clear()

    def _admit_new(self) -> None:
        while not self._inbox.empty():
            handle = self._inbox.get_nowait()
            self._by_seq[handle.seq.seq_id] = handle
            blocks = self.decoder.target.blocks
            self._cached_at_arrival[handle.seq.seq_id] = (  # none reused under a head
                blocks.cached_len(handle.seq.token_ids) if self.decoder.reuses_prefixes else 0)
            if self.metrics:
                self.metrics.prompt_tokens.inc(handle.seq.prompt_len)
            self.scheduler.add(handle.seq)

    def _drop_cancelled(self) -> None:
        for handle in [h for h in self._by_seq.values() if h.is_cancelled]:
            self._finish(handle, FinishReason.CANCELLED)

    def _timed_step(self) -> bool:
        """_step, then what it cost: into the cost model, and for the metrics its wall time
        split into this thread's CPU time, the wait for the proposer and the rest (waiting
        otherwise: the GIL, the forward's intra-op threads)."""
        wall, cpu, before = time.perf_counter(), time.thread_time(), self.decoder.last_timing
        if not self._step():
            return False
        step_s, timing = time.perf_counter() - wall, self.decoder.last_timing
        ran = timing is not before  # (a failed step leaves the timing of the one before)
        if ran:
            self._observe_cost(timing, step_s)
        if self.metrics:
            self.metrics.record_step(step_s, time.thread_time() - cpu,
                                     timing.draft_wait_s if ran else 0.0,
                                     *((timing.tree_rounds, timing.tree_nodes,
                                        timing.ready_only, timing.delivered) if ran else ()))
        return True

    def _step(self) -> bool:
        """One step; False when nothing could be scheduled (waiting for KV room)."""
        heat = self._demand_heat()
        gammas = self._choose_gammas(heat)
        # a sequence preempted and readmitted this step may fall outside the choice
        plan = self.scheduler.schedule(lambda seq: gammas.get(seq.seq_id, 0),
                                       self.decoder.verify_width)
        if not plan.seqs:
            return False
        self.heat = heat
        start = time.perf_counter()
        try:
            committed = self.decoder.step(plan.seqs, plan.gammas, plan.chunk_lens)
        except Exception as exc:  # a failed step fails its requests, not the replica ...
            if _is_group_failure(exc):  # ... unless its tensor-parallel group broke
                self.broken = f"tensor-parallel group failed: {exc}"
            for seq in plan.seqs:
                self._finish(self._by_seq[seq.seq_id], FinishReason.ERROR, str(exc))
            return True
        elapsed = time.perf_counter() - start
        num_tokens = sum(len(c) for c in committed)
        self._stepped = num_tokens
        self.tokens_per_s = 0.9 * self.tokens_per_s + 0.1 * (num_tokens / max(elapsed, 1e-9))
        for seq, tokens in zip(plan.seqs, committed):
            handle = self._by_seq[seq.seq_id]
            if tokens:
                self._report_round(handle, tokens, heat)
            if seq.is_finished:
                self._finish(handle, seq.finish_reason)
        return True

    def _report_round(self, handle: Handle, tokens: list[int], heat: float) -> None:
        """What a sequence's round committed, to its sink, its estimate and the metrics."""
        seq = handle.seq
        r = seq.last_round
        version = self.decoder.draft_version(seq)
        self._learn(handle, r)
        logprobs = seq.logprobs[len(seq.logprobs) - len(tokens):] if seq.logprobs else []
        stats = RoundStats(r.gamma, r.num_accepted, heat, version, r.free_kind, r.num_free,
                           self.decoder.model_method, r.tree_nodes, r.cache_rank)
        self._deliver(handle, Chunk(tokens, [stats], logprobs=logprobs,
                                    num_cached_tokens=seq.num_cached_tokens or 0))
        if self.metrics:
            self.metrics.record_round(stats, handle.spec.mode.value, len(tokens))

    def _demand_heat(self) -> float:
        """Tokens the queued work asks of this step without speculation / the budget. A
        waiting prompt counts whole: measured on the shared-prefix benchmark, counting
        only its uncached part kept speculation on through prefill-heavy steps (TTFT
        99 → 150 ms, 394 → 334 tok/s; BENCHMARKS.md)."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        demand = sum(len(s.token_ids) - s.target_len for s in seqs)
        return demand / self.scheduler.cfg.max_batch_tokens

    def _queued_tokens(self) -> int:
        """Prompt tokens still to compute, a waiting prompt's cached prefix (as it was
        when the request came) not counted: what the router weighs."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        return sum(len(s.token_ids) - max(s.target_len, self._cached_at_arrival.get(s.seq_id, 0))
                   for s in seqs if len(s.token_ids) - s.target_len > 1)

    def _choose_gammas(self, heat: float) -> dict[int, int]:
        """γ for the running sequences and the waiting ones that could join them this
        step; the rest of the queue is not part of this step's batch."""
        room = max(0, self.scheduler.cfg.max_num_seqs - len(self.scheduler.running))
        seqs = [*self.scheduler.running, *itertools.islice(self.scheduler.waiting, room)]
        states = []
        for seq in seqs:
            handle = self._by_seq[seq.seq_id]
            handle.spec.gamma_cap = self.decoder.clip_gamma(seq, handle.gamma_limit)
            states.append(handle.spec)
        gammas = self.policy.choose(heat, states)
        _no_warming_while_off(seqs, states, gammas)
        # a probe tests the model (no lookup stands in); a lookup round stands in for it
        chosen = {**{i: ProposerKind.MODEL for i in self.policy.probed},
                  **{i: ProposerKind.SUFFIX for i in self.policy.looked_up}}
        for i, (seq, state) in enumerate(zip(seqs, states)):
            kind = chosen.get(i)
            seq.round_proposer = kind.value if kind and not state.draft_free else ""
        return {s.seq_id: g for s, g in zip(seqs, gammas)}

    def _observe_cost(self, timing, step_s: float) -> None:
        """The step into the cost model. Its verify time is the whole step on this replica
        but the draft's time: the forward and the bookkeeping around it (γ, acceptance,
        commits, the rounds' reports), which grow with the batch and its γ too: timed as
        the forward alone, AUTO chose γ 4 at 32-64 streams where γ 2 served 7-14 % more."""
        if timing is not None:
            self.cost.observe(timing.batch_tokens, max(timing.verify_s, step_s - timing.draft_s),
                              timing.max_gamma, timing.draft_tokens, timing.draft_s,
                              timing.is_plain)
            self.policy.cost = self.cost.model
            if timing.mask_s and self.metrics:
                self.metrics.mask_seconds.observe(timing.mask_s)

    def acceptance_for(self, params: SamplingParams) -> Acceptance:
        """The replica's estimate for requests like this: constrained or not (a grammar
        changes what the draft gets right), and of the same acceptance class (greedy, or
        sampled at the same temperature: SamplingParams.acceptance_class). A class starts
        at 0.7; the hurdle and the probes of docs/DESIGN.md §4.4 bound what that costs."""
        key = (params.structured_output is not None, params.acceptance_class)
        if key not in self._acceptance:  # (setdefault: a handler thread may race the engine's)
            self._acceptance.setdefault(key, Acceptance([0.7] * self.policy.cfg.gamma_max,
                                                        self.policy.cfg.ewma_weight))
        return self._acceptance[key]

    def _learn(self, handle: Handle, last: Round) -> None:
        """The round into the request's and the replica's acceptance estimates. They size
        the draft model's γ for requests it drafts for: its tokens teach them, the lookups'
        (free, capped by their matches, docs/DESIGN.md §2.8) only for model-free requests."""
        gamma, accepted, num_free = last.gamma, last.num_accepted, last.num_free
        if num_free and not handle.spec.draft_free:
            modelled = model_part(gamma, accepted, num_free)
            if modelled is None:
                return
            gamma, accepted = modelled
        replica = self.acceptance_for(handle.seq.params)
        if gamma:
            handle.spec.acceptance.update(gamma, accepted)
            replica.update(gamma, accepted)
        elif handle.spec.mode is SpecMode.AUTO and self.policy.is_speculating:
            handle.spec.acceptance.drift(replica.alphas)

    def _finish(self, handle: Handle, reason: FinishReason, error: str = "") -> None:
        self.scheduler.remove(handle.seq)
        self.decoder.release(handle.seq)
        self._by_seq.pop(handle.seq.seq_id, None)
        self._cached_at_arrival.pop(handle.seq.seq_id, None)
        with self._lock:
            self._handles.pop(handle.request_id, None)
        self._deliver(handle, Chunk([], finish_reason=reason, error=error))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the target KV; the draft's cache stays valid."""
        self.decoder.target.blocks.free(seq.seq_id)
        seq.target_len = 0

    def load(self) -> ReplicaLoad:
        blocks = self.decoder.target.blocks
        return ReplicaLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self._inbox.qsize(),
            heat=self.heat, kv_used_blocks=blocks.num_used_blocks,
            kv_total_blocks=blocks.num_blocks, tokens_per_s=self.tokens_per_s,
            model_pair=self.model_pair, max_batch_tokens=self.scheduler.cfg.max_batch_tokens,
            block_size=blocks.block_size,
            # a head turns prefix reuse off (docs/DESIGN.md §8.8)
            prefix_caching=blocks.prefix_caching and self.decoder.reuses_prefixes,
            queued_tokens=self._queued_tokens())


def _is_group_failure(exc: Exception) -> bool:
    """A collective failed: a peer rank crashed or the network between them went."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or any(
        word in str(exc) for word in ("gloo", "NCCL", "Connection closed by peer"))
