"""The target replica's gRPC service: Generate (server stream), Cancel, GetLoad."""

from __future__ import annotations

import queue
import uuid

import grpc
from opentelemetry import trace
from outrider.router.policy import MAX_GAMMA, Acceptance, CostModel, RequestState, SpecMode
from outrider.target_worker.engine import Handle, TargetEngine
from outrider.target_worker.remote_drafter import DraftReplicaError

from outrider.engine.sampling import SamplingError
from outrider.engine.spec_decode import RequestError, SpecStats
from outrider.telemetry.tracing import (
    context_from_metadata,
    request_attributes,
    round_event,
    spec_attributes,
    traceparent_of,
    tracer,
)
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import sampling_from_proto

SPEC_MODES = {pb.SPEC_MODE_AUTO: SpecMode.AUTO, pb.SPEC_MODE_OFF: SpecMode.OFF,
              pb.SPEC_MODE_FIXED: SpecMode.FIXED}


class TargetService(worker_pb2_grpc.TargetServicer):
    def __init__(self, engine: TargetEngine, default_gamma: int, cost: CostModel,
                 auto_gamma_max: int | None = None) -> None:
        self.engine = engine
        self.default_gamma = default_gamma            # FIXED requests that set no γ
        self.auto_gamma_max = default_gamma if auto_gamma_max is None else auto_gamma_max
        self.cost = pb.CostModel(**vars(cost))

    def Generate(self, request: pb.TargetRequest, context):
        span = tracer().start_span(
            f"text_completion {self.engine.decoder.target.model_name}",
            context_from_metadata(context.invocation_metadata()), kind=trace.SpanKind.SERVER)
        try:
            yield from self._generate(request, context, span)
        finally:
            span.end()

    def _generate(self, request: pb.TargetRequest, context, span: trace.Span):
        if self.engine.broken:  # the router takes this as: try another replica
            context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.broken)
        try:
            handle = self._handle(request)
            self.engine.submit(handle)
        except (SamplingError, RequestError, ValueError) as exc:
            span.set_status(trace.StatusCode.ERROR, str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        handle.seq.traceparent = traceparent_of(span)
        span.set_attributes(self._attributes(handle))
        # runs when the stream ends for any reason, a client disconnect included
        context.add_callback(lambda: self.engine.cancel(handle.request_id))
        stats = SpecStats()
        while True:
            try:
                chunk = handle.chunks.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():  # cancelled or the server is stopping
                    return
                continue
            if chunk.finish_reason.startswith("error"):
                span.set_status(trace.StatusCode.ERROR, chunk.finish_reason)
                context.abort(grpc.StatusCode.INTERNAL, chunk.finish_reason)
            for gamma, accepted, heat in chunk.rounds:
                stats.record(gamma, accepted)
                round_event(span, gamma, accepted, heat)
            yield pb.TargetChunk(
                token_ids=chunk.token_ids, finish_reason=chunk.finish_reason,
                rounds=[pb.RoundStats(gamma=g, num_accepted=a, heat=h) for g, a, h in chunk.rounds])
            if chunk.finish_reason:
                span.set_attributes({**spec_attributes(stats),
                                     "gen_ai.response.finish_reasons": [chunk.finish_reason],
                                     "gen_ai.usage.output_tokens": handle.seq.num_output})
                return

    def _attributes(self, handle: Handle) -> dict:
        seq = handle.seq
        return {**request_attributes(self.engine.decoder.target.model_name, seq.params,
                                     handle.request_id),
                "gen_ai.operation.name": "text_completion",
                "gen_ai.usage.input_tokens": seq.prompt_len,
                "outrider.spec.mode": handle.spec.mode.value,
                "outrider.spec.gamma_max": handle.gamma_limit,
                "outrider.model_pair": self.engine.model_pair}

    def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        return pb.CancelResponse(found=self.engine.cancel(request.request_id))

    def SetDraftReplicas(self, request: pb.DraftReplicas, context) -> pb.DraftReplicas:
        drafter = self.engine.decoder.drafter
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
        return pb.Load(**self.engine.load(), cost=self.cost, gamma_max=self.auto_gamma_max)

    def _handle(self, request: pb.TargetRequest) -> Handle:
        if request.gamma > MAX_GAMMA:
            raise ValueError(f"gamma={request.gamma} exceeds {MAX_GAMMA}")
        params, _ = sampling_from_proto(
            request.sampling, max_tokens=request.max_tokens,
            stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos)
        if request.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode={request.spec_mode} is not a SpecMode")
        if any(not 0 <= a <= 1 for a in request.acceptance_prior):
            raise ValueError("acceptance_prior values must be probabilities in [0, 1]")
        seq = self.engine.decoder.new_sequence(list(request.prompt_ids), params,
                                               list(request.resume_output_ids))
        mode = SPEC_MODES[request.spec_mode]
        default = self.auto_gamma_max if mode == SpecMode.AUTO else self.default_gamma
        gamma = request.gamma or default  # FIXED: γ; AUTO: γ_max
        prior = list(request.acceptance_prior) or list(self.engine.acceptance.alphas)
        spec = RequestState(Acceptance(prior, self.engine.policy.cfg.ewma_weight), mode,
                            fixed_gamma=gamma)
        return Handle(request.request_id or uuid.uuid4().hex, seq, spec, gamma_limit=gamma)
