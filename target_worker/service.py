"""The target replica's gRPC service: Serve (a router's multiplexed stream), Generate
(one request's stream), Cancel, GetLoad, SetDraftReplicas."""

from __future__ import annotations

import dataclasses
import queue
import threading
import uuid
from collections.abc import Iterator

import grpc
from opentelemetry import trace
from outrider.target_worker.engine import Chunk, ChunkQueue, Handle, TargetEngine
from outrider.target_worker.remote_drafter import DraftReplicaError

from outrider.core.policy import MAX_GAMMA, Acceptance, RequestState, SpecMode
from outrider.core.sampling import SamplingError, logprobs_to_proto, sampling_from_proto
from outrider.core.sequence import FinishReason, ProposerKind
from outrider.core.stats import SpecStats
from outrider.engine.mix import ProposerMix
from outrider.engine.spec_decode import RequestError
from outrider.telemetry.tracing import (
    context_from_metadata,
    context_from_traceparent,
    request_attributes,
    round_event,
    spec_attributes,
    traceparent_of,
    tracer,
)
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

SPEC_MODES = {pb.SPEC_MODE_AUTO: SpecMode.AUTO, pb.SPEC_MODE_OFF: SpecMode.OFF,
              pb.SPEC_MODE_FIXED: SpecMode.FIXED}


class Refusal(Exception):
    """A request the replica will not run: its status code and why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class RequestSpan:
    """The target's span of one request: its attributes, a round event per round, its
    speculation figures when it ends."""

    def __init__(self, engine: TargetEngine, handle: Handle, parent) -> None:
        model = engine.decoder.target.model_name
        self.span = tracer().start_span(f"text_completion {model}", parent,
                                        kind=trace.SpanKind.SERVER)
        self.stats = SpecStats()
        self.has_output = False
        handle.seq.traceparent = traceparent_of(self.span)
        seq = handle.seq
        self.span.set_attributes({
            **request_attributes(model, seq.params, handle.request_id),
            "gen_ai.operation.name": "text_completion",
            "gen_ai.usage.input_tokens": seq.prompt_len,
            "outrider.spec.mode": handle.spec.mode.value,
            "outrider.spec.gamma_max": handle.gamma_limit,
            "outrider.spec.proposer": seq.proposer or "default",
            "outrider.model_pair": engine.model_pair})

    def record(self, handle: Handle, chunk: Chunk) -> None:
        if chunk.token_ids and not self.has_output:
            self.has_output = True
            self.span.set_attribute("gen_ai.usage.cache_read.input_tokens",
                                    chunk.num_cached_tokens)
        for r in chunk.rounds:
            self.stats.record(r.gamma, r.num_accepted, r.free_kind, r.num_free, r.model_method)
            round_event(self.span, r)
        if chunk.finish_reason is FinishReason.ERROR:
            self.span.set_status(trace.StatusCode.ERROR, finish_text(chunk))
        elif chunk.finish_reason:
            self.span.set_attributes({**spec_attributes(self.stats),
                                      "gen_ai.response.finish_reasons": [finish_text(chunk)],
                                      "gen_ai.usage.output_tokens": handle.seq.num_output})

    def fail(self, message: str) -> None:
        self.span.set_status(trace.StatusCode.ERROR, message)

    def end(self) -> None:
        self.span.end()


def finish_text(chunk: Chunk) -> str:
    """The finish reason as the wire says it: "" while the request runs, and
    "error: <what failed it>" for a failure."""
    if chunk.finish_reason is FinishReason.ERROR:
        return f"error: {chunk.error}"
    return chunk.finish_reason or ""


def chunk_message(chunk: Chunk) -> pb.TargetChunk:
    return pb.TargetChunk(token_ids=chunk.token_ids, finish_reason=finish_text(chunk),
                          rounds=[pb.RoundStats(**r._asdict()) for r in chunk.rounds],
                          logprobs=logprobs_to_proto(chunk.logprobs),
                          num_cached_tokens=chunk.num_cached_tokens)


class ServeSession:
    """One router's Serve stream: it starts and cancels requests through the stream, and
    every engine step answers with one ServeStep for all of them (a ChunkSink)."""

    def __init__(self, service: TargetService, context) -> None:
        self.service, self.context = service, context
        self._outputs: list[pb.StepOutput | tuple[Handle, Chunk]] = []  # refusals, chunks
        self._spans: dict[str, RequestSpan] = {}   # its running requests
        self._handles: dict[str, Handle] = {}
        self._ready = threading.Condition()
        self._is_closed = False
        self._is_input_done = False  # the router has sent all it will

    # -- the engine's side (a ChunkSink): no more than a list append on its thread ------------
    def deliver(self, handle: Handle, chunk: Chunk) -> None:
        with self._ready:
            self._outputs.append((handle, chunk))

    def flush(self) -> None:
        with self._ready:
            self._ready.notify()

    # -- the stream ----------------------------------------------------------------------------
    def run(self, requests: Iterator[pb.ServeRequest]) -> Iterator[pb.ServeStep]:
        """Until the router goes away, or has sent all it will and nothing runs."""
        threading.Thread(target=self._read, args=(requests,), daemon=True,
                         name="serve-reader").start()
        self.context.add_callback(self._close)  # the router left or the stream broke
        try:
            while True:
                with self._ready:
                    self._ready.wait_for(lambda: self._outputs or self._is_over, timeout=1.0)
                    outputs, self._outputs = self._outputs, []
                    if not outputs and self._is_over:
                        return
                if outputs:
                    yield pb.ServeStep(outputs=[self._message(o) for o in outputs])
        finally:
            self._close()

    def _message(self, output: pb.StepOutput | tuple[Handle, Chunk]) -> pb.StepOutput:
        """A step's output for one request (its span records the chunk)."""
        if isinstance(output, pb.StepOutput):
            return output
        handle, chunk = output
        message = pb.StepOutput(request_id=handle.request_id, chunk=chunk_message(chunk))
        if chunk.finish_reason is FinishReason.ERROR:
            message.error_code = grpc.StatusCode.INTERNAL.value[0]
            message.error_message = finish_text(chunk)
        span = self._spans.get(handle.request_id)
        if span is not None:
            span.record(handle, chunk)
        if chunk.finish_reason:
            self._end(handle.request_id)
        return message

    @property
    def _is_over(self) -> bool:
        return self._is_closed or (self._is_input_done and not self._handles)

    def _read(self, requests: Iterator[pb.ServeRequest]) -> None:
        try:
            for message in requests:
                if message.HasField("start"):
                    self._start(message.start)
                elif message.HasField("cancel"):
                    self.service.engine.cancel(message.cancel.request_id)
        except grpc.RpcError:
            self._close()  # the stream broke: nobody will read what runs on it
        finally:
            with self._ready:
                self._is_input_done = True
                self._ready.notify()

    def _start(self, request: pb.TargetRequest) -> None:
        parent = context_from_traceparent(request.traceparent)
        try:
            if not request.request_id or request.request_id in self._handles:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id {request.request_id!r} is empty or running already")
            handle = self.service.admit(request, sink=self)
        except Refusal as refusal:
            self._refused(request.request_id, refusal, parent)
            return
        # known before the engine can deliver its first chunk
        self._spans[handle.request_id] = RequestSpan(self.service.engine, handle, parent)
        self._handles[handle.request_id] = handle
        try:
            self.service.submit(handle)
        except Refusal as refusal:  # running on another router's stream
            self._end(handle.request_id)
            self._refused(request.request_id, refusal, parent)

    def _refused(self, request_id: str, refusal: Refusal, parent) -> None:
        span = tracer().start_span("text_completion", parent, kind=trace.SpanKind.SERVER)
        span.set_status(trace.StatusCode.ERROR, refusal.message)
        span.end()
        with self._ready:
            self._outputs.append(pb.StepOutput(request_id=request_id,
                                               error_code=refusal.code.value[0],
                                               error_message=refusal.message))
            self._ready.notify()

    def _end(self, request_id: str) -> None:
        span = self._spans.pop(request_id, None)
        with self._ready:
            self._handles.pop(request_id, None)
            self._ready.notify()
        if span is not None:
            span.end()

    def _close(self) -> None:
        """Nobody is left to read: cancel what still runs for this router."""
        with self._ready:
            if self._is_closed:
                return
            self._is_closed = True
            self._ready.notify()
        for request_id in list(self._handles):
            self.service.engine.cancel(request_id)


class TargetService(worker_pb2_grpc.TargetServicer):
    def __init__(self, engine: TargetEngine, default_gamma: int,
                 auto_gamma_max: int | None = None, metrics_port: int = 0,
                 target_vocab: str = "") -> None:
        self.engine = engine
        self.metrics_port = metrics_port  # told to routers, which serve what it holds
        self.target_vocab = target_vocab  # told to routers, which match it to their models
        self.default_gamma = default_gamma            # FIXED requests that set no γ
        self.auto_gamma_max = default_gamma if auto_gamma_max is None else auto_gamma_max

    def Serve(self, request_iterator, context):
        yield from ServeSession(self, context).run(request_iterator)

    def Generate(self, request: pb.TargetRequest, context):
        parent = context_from_metadata(context.invocation_metadata())
        sink = ChunkQueue()
        try:
            handle = self.admit(request, sink)
        except Refusal as refusal:
            context.abort(refusal.code, refusal.message)
        span = RequestSpan(self.engine, handle, parent)
        try:
            self.submit(handle)
        except Refusal as refusal:
            span.fail(refusal.message)
            span.end()
            context.abort(refusal.code, refusal.message)
        # runs when the stream ends for any reason, a client disconnect included
        context.add_callback(lambda: self.engine.cancel(handle.request_id))
        try:
            yield from self._stream(handle, sink, span, context)
        finally:
            span.end()

    def _stream(self, handle: Handle, sink: ChunkQueue, span: RequestSpan, context):
        while True:
            try:
                chunk = sink.chunks.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():  # cancelled or the server is stopping
                    return
                continue
            span.record(handle, chunk)
            if chunk.finish_reason is FinishReason.ERROR:
                context.abort(grpc.StatusCode.INTERNAL, finish_text(chunk))
            yield chunk_message(chunk)
            if chunk.finish_reason:
                return

    def admit(self, request: pb.TargetRequest, sink) -> Handle:
        """The request as a Handle whose chunks go to `sink`; Refusal when the replica
        cannot run it."""
        if self.engine.broken:  # the router takes this as: try another replica
            raise Refusal(grpc.StatusCode.UNAVAILABLE, self.engine.broken)
        try:
            return self._handle(request, sink)
        except (SamplingError, RequestError, ValueError) as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def submit(self, handle: Handle) -> None:
        try:
            self.engine.submit(handle)
        except ValueError as exc:  # its request id is running already
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        return pb.CancelResponse(found=self.engine.cancel(request.request_id))

    def SetDraftReplicas(self, request: pb.DraftReplicas, context) -> pb.DraftReplicas:
        drafter = self.engine.decoder.drafter
        drafter = drafter.model if isinstance(drafter, ProposerMix) else drafter
        if not hasattr(drafter, "set_addresses"):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this replica was started without draft replicas")
        try:
            drafter.set_addresses(list(request.addresses))
        except DraftReplicaError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.DraftReplicas(addresses=request.addresses)

    def GetLoad(self, request, context) -> pb.Load:
        if self.engine.broken:  # out of every router's live set until replaced
            context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.broken)
        cost = pb.CostModel(**vars(self.engine.policy.cost))  # as the latest steps measured it
        return pb.Load(**dataclasses.asdict(self.engine.load()), cost=cost,
                       gamma_max=self.auto_gamma_max, metrics_port=self.metrics_port,
                       target_vocab=self.target_vocab)

    def _handle(self, request: pb.TargetRequest, sink) -> Handle:
        if request.gamma > MAX_GAMMA:
            raise ValueError(f"gamma={request.gamma} exceeds {MAX_GAMMA}")
        params, _ = sampling_from_proto(
            request.sampling, max_tokens=request.max_tokens,
            stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos,
            logprobs=request.logprobs if request.HasField("logprobs") else None)
        if request.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode={request.spec_mode} is not a SpecMode")
        if any(not 0 <= a <= 1 for a in request.acceptance_prior):
            raise ValueError("acceptance_prior values must be probabilities in [0, 1]")
        kind = ProposerKind.parse(request.proposer) if request.proposer else None
        seq = self.engine.decoder.new_sequence(list(request.prompt_ids), params,
                                               list(request.resume_output_ids))
        seq.proposer = kind.value if kind else ""
        seq.tree = self.engine.decoder.request_tree(request.tree_topk, request.tree_tokens)
        mode = SPEC_MODES[request.spec_mode]
        default = self.auto_gamma_max if mode == SpecMode.AUTO else self.default_gamma
        gamma = request.gamma or default  # FIXED: γ; AUTO: γ_max
        prior = (list(request.acceptance_prior)
                 or list(self.engine.acceptance_for(params).alphas))
        drafter = self.engine.decoder.drafter
        mix = drafter if isinstance(drafter, ProposerMix) else None
        spec = RequestState(Acceptance(prior, self.engine.policy.cfg.ewma_weight), mode,
                            fixed_gamma=gamma,
                            draft_free=mix is not None and mix.is_model_free(kind),
                            looks_up=mix is not None and mix.stands_in_for_model(kind, params))
        return Handle(request.request_id or uuid.uuid4().hex, seq, spec, sink=sink,
                      gamma_limit=gamma)
