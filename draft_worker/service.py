"""The draft replica's gRPC service: Propose for many sequences in one call."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import grpc
import torch
from opentelemetry import trace
from outrider.draft_worker.spec_cache import Entry, SpeculationCache

from outrider.core.sampling import SamplingError, sampling_from_proto
from outrider.dense_channel import DenseChannel
from outrider.engine.drafter import Drafter
from outrider.engine.proposer import DraftItem
from outrider.telemetry.metrics import DraftMetrics
from outrider.telemetry.tracing import context_from_traceparent, tracer
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import Q_FORMAT_NAMES, WireError, decode_features, encode_proposal

MAX_GAMMA = 32
SEND_TIMEOUT = timedelta(seconds=5)


class SequenceSpans:
    """One span per draft sequence, from the Propose that starts it to its release or
    eviction, in the trace of the request it serves (one Propose serves many requests,
    so the trace context rides on each sequence, not on the call)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._open: dict[str, tuple[trace.Span, list[int]]] = {}  # span, [proposals, tokens]

    def proposed(self, item: DraftItem, num_tokens: int) -> None:
        if item.traceparent and item.seq_id not in self._open:
            span = tracer().start_span(
                f"draft {self.model_name}", context_from_traceparent(item.traceparent),
                kind=trace.SpanKind.SERVER,
                attributes={"gen_ai.operation.name": "draft",
                            "gen_ai.request.model": self.model_name,
                            "outrider.draft.sequence_id": item.seq_id})
            self._open[item.seq_id] = (span, [0, 0])
        if item.seq_id in self._open:
            counts = self._open[item.seq_id][1]
            counts[0] += 1
            counts[1] += num_tokens

    def close(self, seq_ids) -> None:
        for seq_id in seq_ids:
            span, (proposals, tokens) = self._open.pop(seq_id, (None, (0, 0)))
            if span is not None:
                span.set_attributes({"outrider.draft.proposals": proposals,
                                     "outrider.draft.tokens": tokens})
                span.end()

    def close_evicted(self, is_cached) -> None:
        self.close([seq_id for seq_id in self._open if not is_cached(seq_id)])


class DraftService(worker_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, proposers: dict | None = None,
                 idle_ttl_s: float = 300.0,
                 dense_channel: DenseChannel | None = None,
                 metrics: DraftMetrics | None = None,
                 cores: tuple[list[int], list[int]] | None = None,
                 speculation_cache: bool = False, sampled_weight: float | None = None) -> None:
        self.drafter = drafter
        # what proposes for each target vocabulary (draft_worker/main.proposers_of): the
        # drafter, or the drafter through text for a target of another tokenizer
        self.proposers = proposers or {"": drafter}
        self._distinct = list({id(p): p for p in self.proposers.values()}.values())
        # (while the target waits, while it verifies): a draft on the target's machine
        # drafts on the target's idle cores when it waits, beside them when it verifies
        self.cores = cores
        self.idle_ttl_s = idle_ttl_s
        self.dense_channel = dense_channel
        self.metrics = metrics
        self.spans = SequenceSpans(drafter.model_name)
        self._pending_send = None  # (work, buffer) of the last dense-channel send
        self.num_dense_sends = 0
        self.draft_seconds_total = 0.0  # time spent drafting: the autoscaler's load signal
        self.lock = threading.Lock()  # one model, one forward (or weight swap) at a time
        self.adapter = None  # online distillation (draft_worker/adapt.py), when on
        # drafts for the outcomes of the verification under way (spec_cache.py), drafted
        # by one background thread between Proposes; Proposes waiting for the lock
        self.cache = (SpeculationCache(drafter, sampled_weight=sampled_weight,
                                       on_lookup=metrics.cache_lookup if metrics else None)
                      if speculation_cache else None)
        self._preparing = ThreadPoolExecutor(1, "speculation-cache") if self.cache else None
        self._waiting, self._waiting_lock = 0, threading.Lock()

    def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        proposer = self._proposer(request.target_vocab, context)
        try:
            items = [self._item(s, proposer.vocab_size) for s in request.sequences]
        except (SamplingError, WireError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        is_dist = [it.q_format == "dense_dist" for it in items]
        if any(is_dist) and not (self.dense_channel and self.dense_channel.wait_ready(30)):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "Q_FORMAT_DENSE_DIST needs a dense channel (--dist-address)")
        start = time.perf_counter()
        delivers = self._caching and any(it.deliver for it in items)
        if delivers:  # what earlier Proposes had the cache prepare is drafted first
            self._preparing.submit(lambda: None).result()
        self._wait(+1)
        with self.lock:
            self._wait(-1)
            if self.cores is not None:  # this thread drafts: move it where it belongs
                os.sched_setaffinity(0, self.cores[request.beside_target])
            if sum(p.evict_idle(self.idle_ttl_s) for p in self._distinct):
                self.spans.close_evicted(self.drafter.runner.blocks.has)
            cached = self.cache.take(items) if self._caching else [None] * len(items)
            # a miss that asked for ready drafts only is answered at once, with none
            waits = [it.ready_only and it.gamma > 0 and self._caching for it in items]
            asked = [it for it, entry, w in zip(items, cached, waits)
                     if entry is None and not w and not it.collects]
            out = proposer.draft(asked, torch.device("cpu")) if asked else None
            rows = _rows(items, cached, waits, out, proposer.holds)
            if any(is_dist):  # (a dense_dist row is never cached: all of them were asked)
                try:
                    self._send_dense(out, [it.q_format == "dense_dist" for it in asked],
                                     request.dist_tag)
                except RuntimeError as exc:  # the pair is out of step: the target falls back
                    self.dense_channel.mark_broken()
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"dense q channel broken: {exc}")
            version = self.drafter.version  # the weights that drafted (swaps hold the lock)
            if self._caching and (delivers or not request.beside_target):
                # (drafting ahead's items beside the target are not planned for)
                plans = self.cache.plan(
                    [it if it.deliver or not request.beside_target else replace(it, prepare=False)
                     for it in items], [row[0] for row in rows])
                if delivers:  # the target collects them with this answer
                    self._fill(plans)
                else:
                    self._preparing.submit(self._prepare, plans)
            delivered = [[pb.PreparedOutcome(outcome=outcome, token_ids=entry.drafts,
                                             rank=entry.rank)
                          for outcome, entry in self.cache.prepared(it.seq_id)]
                         if it.deliver and delivers else [] for it in items]
        proposals = []
        for it, (ids, q_rows, miss, rank), outcomes in zip(items, rows, delivered):
            msg = encode_proposal(it.seq_id, ids, q_rows, it.q_format)
            msg.miss, msg.cache_rank = miss, rank
            msg.prepared.extend(outcomes)
            proposals.append(msg)
        seconds = time.perf_counter() - start
        self._observe(items, rows, seconds)
        return pb.ProposeResponse(proposals=proposals, draft_seconds=seconds,
                                  draft_version=version, target_topk=self.drafter.target_topk)

    def _proposer(self, target_vocab: str, context):
        """The proposer for the calling target's vocabulary; a replica started for no
        target in particular drafts in its own for any."""
        if target_vocab in self.proposers:
            return self.proposers[target_vocab]
        if len(self.proposers) == 1:
            return self.drafter
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"this draft replica drafts for {len(self.proposers) - 1} target "
                      f"vocabularies (its --target-model), not {target_vocab!r}: start it "
                      f"with this target's folder as --target-model too")

    def _wait(self, change: int) -> None:
        with self._waiting_lock:
            self._waiting += change

    @property
    def _caching(self) -> bool:
        """A draft that learns while serving keeps no stand-ins: their made-up contexts
        would reach its training data when weights are swapped."""
        return self.cache is not None and self.adapter is None

    def _prepare(self, plans) -> None:
        """Draft the stand-ins while the target verifies, unless a Propose is already
        waiting for the model (it comes first: the stand-ins are only ever a head start)."""
        if not plans or self._waiting:
            return
        with self.lock:
            if self._waiting:
                return
            self._fill(plans)

    def _fill(self, plans) -> None:
        """Draft the stand-ins beside the target's verification (the caller holds the
        lock), until a Propose waits for the model."""
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores[True])
        drafted = self.cache.fill(plans, interrupted=lambda: self._waiting > 0)
        if self.metrics:
            self.metrics.stand_ins.inc(drafted)

    def _observe(self, items: list[DraftItem], rows, seconds: float) -> None:
        with self.lock:
            self.draft_seconds_total += seconds
            for it, row in zip(items, rows):
                self.spans.proposed(it, len(row[0]))
        if self.metrics:
            self.metrics.seconds.observe(seconds)
            self.metrics.proposals.inc(len(items))
            self.metrics.tokens.inc(sum(len(row[0]) for row in rows))
            self.metrics.misses.inc(sum(row[2] for row in rows))

    def _send_dense(self, out, is_dist: list[bool], tag: int) -> None:
        """One send of every dense_dist row, in request order; the target receives it
        after reading this call's reply."""
        rows = [out.probs[i, :g] for i, g in enumerate(out.gammas) if is_dist[i] and g]
        if not rows:
            return
        previous, self._pending_send = self._pending_send, None
        if previous is not None:
            previous[0].wait(SEND_TIMEOUT)  # raises if the target never took it
        self._pending_send = self.dense_channel.send(torch.cat(rows), tag)
        self.num_dense_sends += 1

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        with self.lock:
            if self.cache is not None:
                self.cache.forget(request.seq_ids)
            released = sum(any([p.release(seq_id) for p in self._distinct])
                           for seq_id in request.seq_ids)
            self.spans.close(request.seq_ids)
        return pb.ReleaseResponse(num_released=released)

    def Stats(self, request, context) -> pb.DraftStats:
        blocks = self.drafter.runner.blocks
        proposer = self._proposer(request.target_vocab, context)
        return pb.DraftStats(num_sequences=blocks.num_sequences,
                             num_used_blocks=blocks.num_used_blocks,
                             num_total_blocks=blocks.num_blocks,
                             num_evicted=self.drafter.num_evicted,
                             num_misses=self.drafter.num_misses,
                             vocab_size=proposer.vocab_size,
                             max_model_len=self.drafter.max_model_len,
                             num_dense_sends=self.num_dense_sends,
                             model_name=self.drafter.model_name,
                             method=proposer.method,
                             feature_width=self._feature_width,
                             speculation_cache=self._caching)

    @property
    def _feature_width(self) -> int:
        """A head's (HeadRunner.feature_width); 0 for a draft model."""
        return getattr(self.drafter.runner, "feature_width", 0)

    def _item(self, s: pb.ProposeSequence, vocab: int) -> DraftItem:
        where = f"sequences[{s.seq_id!r}]"
        if not s.seq_id:
            raise WireError("sequences[].seq_id is empty")
        if s.gamma > MAX_GAMMA:
            raise WireError(f"{where}.gamma={s.gamma} exceeds {MAX_GAMMA}")
        if s.q_format not in Q_FORMAT_NAMES:
            raise WireError(f"{where}.q_format is not set")
        if any(not 0 <= t < vocab for t in s.new_token_ids):
            raise WireError(f"{where}.new_token_ids holds ids outside [0, {vocab})")
        if s.committed_len + len(s.new_token_ids) == 0 and s.gamma:
            raise WireError(f"{where}: nothing to draft from (empty context)")
        params, seed = sampling_from_proto(s.sampling)
        return DraftItem(s.seq_id, s.committed_len, list(s.new_token_ids), s.gamma, params,
                         seed, Q_FORMAT_NAMES[s.q_format], s.traceparent, s.prefill_only,
                         s.prompt_len, self._teacher(s, where, vocab),
                         features=self._features(s, where), ready_only=s.ready_only,
                         prepare=not s.unprepared, deliver=s.deliver)

    def _features(self, s: pb.ProposeSequence, where: str) -> torch.Tensor | None:
        """A head's input rows (one per new token); a head drafts nothing without them."""
        width = self._feature_width
        if not width:
            if s.HasField("features"):
                raise WireError(f"{where}.features: this replica runs a draft model, which "
                                f"reads no features")
            return None
        if not s.HasField("features"):
            if s.gamma:
                raise WireError(f"{where}.features: the head drafts from the target's "
                                f"features, and none came")
            return None
        return decode_features(s.features, len(s.new_token_ids), width, where)

    @staticmethod
    def _teacher(s: pb.ProposeSequence, where: str, vocab: int) -> list:
        rows = []
        for row in s.teacher:
            if len(row.token_ids) != len(row.logprobs) or any(
                    not 0 <= t < vocab for t in row.token_ids):
                raise WireError(f"{where}.teacher[position={row.position}]: token_ids must "
                                f"be ids in [0, {vocab}), as many as logprobs")
            rows.append((row.position, tuple(row.token_ids), tuple(row.logprobs)))
        return rows


def _rows(items: list[DraftItem], cached: list[Entry | None], waits: list[bool], out,
          holds) -> list[tuple[list[int], torch.Tensor | None, bool, int]]:
    """Per sequence of a Propose, (draft tokens, their q rows as sent or None, MISS, cache
    rank): a hit's from the speculation cache; none for a ready-only miss (MISS if the
    draft lacks its prefix: `holds`); the others' from `out`, drafted for them in order."""
    rows, k = [], 0
    for it, entry, waits_a_round in zip(items, cached, waits):
        if entry is not None:
            rows.append((entry.drafts, entry.q, False, entry.rank))
        elif it.collects:  # (what it prepared comes with the answer: Proposal.prepared)
            rows.append(([], None, False, 0))
        elif waits_a_round:
            rows.append(([], None, not holds(it), 0))
        else:
            g = out.gammas[k]
            rows.append((out.token_ids[k, :g].tolist(),
                         None if out.probs is None else out.probs[k, :g],
                         bool(out.is_miss[k]), 0))
            k += 1
    return rows
