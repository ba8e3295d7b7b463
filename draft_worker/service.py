"""The draft replica's gRPC service: Propose for many sequences in one call."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import grpc
import torch

from outrider.dense_channel import DenseChannel
from outrider.engine.drafter import Drafter, DraftItem
from outrider.engine.sampling import SamplingError
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import Q_FORMAT_NAMES, WireError, encode_proposal, sampling_from_proto

MAX_GAMMA = 32
SEND_TIMEOUT = timedelta(seconds=5)


class DraftService(worker_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, idle_ttl_s: float = 300.0,
                 dense_channel: DenseChannel | None = None) -> None:
        self.drafter = drafter
        self.idle_ttl_s = idle_ttl_s
        self.dense_channel = dense_channel
        self._pending_send = None  # (work, buffer) of the last dense-channel send
        self.num_dense_sends = 0
        self._lock = threading.Lock()  # one model, one forward at a time

    def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        try:
            items = [self._item(s) for s in request.sequences]
        except (SamplingError, WireError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        is_dist = [it.q_format == "dense_dist" for it in items]
        if any(is_dist) and not (self.dense_channel and self.dense_channel.wait_ready(30)):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "Q_FORMAT_DENSE_DIST needs a dense channel (--dist-address)")
        start = time.perf_counter()
        with self._lock:
            self.drafter.evict_idle(self.idle_ttl_s)
            out = self.drafter.draft(items, torch.device("cpu"))
            if any(is_dist):
                try:
                    self._send_dense(out, is_dist, request.dist_tag)
                except RuntimeError as exc:  # the pair is out of step: the target falls back
                    self.dense_channel.mark_broken()
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"dense q channel broken: {exc}")
        proposals = []
        for i, it in enumerate(items):
            g = out.gammas[i]
            msg = encode_proposal(it.seq_id, out.token_ids[i, :g].tolist(), out.probs[i, :g],
                                  it.q_format)
            msg.miss = out.is_miss[i]
            proposals.append(msg)
        return pb.ProposeResponse(proposals=proposals, draft_seconds=time.perf_counter() - start)

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
        with self._lock:
            released = sum(self.drafter.release(seq_id) for seq_id in request.seq_ids)
        return pb.ReleaseResponse(num_released=released)

    def Stats(self, request, context) -> pb.DraftStats:
        blocks = self.drafter.runner.blocks
        return pb.DraftStats(num_sequences=blocks.num_sequences,
                             num_used_blocks=blocks.num_used_blocks,
                             num_total_blocks=blocks.num_blocks,
                             num_evicted=self.drafter.num_evicted,
                             num_misses=self.drafter.num_misses,
                             vocab_size=self.drafter.vocab_size,
                             max_model_len=self.drafter.max_model_len,
                             num_dense_sends=self.num_dense_sends,
                             model_name=self.drafter.model_name)

    def _item(self, s: pb.ProposeSequence) -> DraftItem:
        where = f"sequences[{s.seq_id!r}]"
        if not s.seq_id:
            raise WireError("sequences[].seq_id is empty")
        if s.gamma > MAX_GAMMA:
            raise WireError(f"{where}.gamma={s.gamma} exceeds {MAX_GAMMA}")
        if s.q_format not in Q_FORMAT_NAMES:
            raise WireError(f"{where}.q_format is not set")
        vocab = self.drafter.vocab_size
        if any(not 0 <= t < vocab for t in s.new_token_ids):
            raise WireError(f"{where}.new_token_ids holds ids outside [0, {vocab})")
        if s.committed_len + len(s.new_token_ids) == 0 and s.gamma:
            raise WireError(f"{where}: nothing to draft from (empty context)")
        params, seed = sampling_from_proto(s.sampling)
        return DraftItem(s.seq_id, s.committed_len, list(s.new_token_ids), s.gamma, params,
                         seed, Q_FORMAT_NAMES[s.q_format])
