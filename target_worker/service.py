"""The target replica's gRPC service: Generate (server stream), Cancel, GetLoad."""

from __future__ import annotations

import queue
import uuid

import grpc
from outrider.router.policy import MAX_GAMMA, Acceptance, CostModel, RequestState, SpecMode
from outrider.target_worker.engine import Handle, TargetEngine

from outrider.engine.sampling import SamplingError
from outrider.engine.spec_decode import RequestError
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import sampling_from_proto

SPEC_MODES = {pb.SPEC_MODE_AUTO: SpecMode.AUTO, pb.SPEC_MODE_OFF: SpecMode.OFF,
              pb.SPEC_MODE_FIXED: SpecMode.FIXED}


class TargetService(worker_pb2_grpc.TargetServicer):
    def __init__(self, engine: TargetEngine, default_gamma: int, cost: CostModel) -> None:
        self.engine = engine
        self.default_gamma = default_gamma
        self.cost = pb.CostModel(**vars(cost))

    def Generate(self, request: pb.TargetRequest, context):
        try:
            handle = self._handle(request)
            self.engine.submit(handle)
        except (SamplingError, RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # runs when the stream ends for any reason, a client disconnect included
        context.add_callback(lambda: self.engine.cancel(handle.request_id))
        while True:
            try:
                chunk = handle.chunks.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():  # cancelled or the server is stopping
                    return
                continue
            if chunk.finish_reason.startswith("error"):
                context.abort(grpc.StatusCode.INTERNAL, chunk.finish_reason)
            yield pb.TargetChunk(
                token_ids=chunk.token_ids, finish_reason=chunk.finish_reason,
                rounds=[pb.RoundStats(gamma=g, num_accepted=a, heat=h) for g, a, h in chunk.rounds])
            if chunk.finish_reason:
                return

    def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        return pb.CancelResponse(found=self.engine.cancel(request.request_id))

    def GetLoad(self, request, context) -> pb.Load:
        return pb.Load(**self.engine.load(), cost=self.cost, gamma_max=self.default_gamma)

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
        gamma = request.gamma or self.default_gamma  # FIXED: γ; AUTO: γ_max
        prior = list(request.acceptance_prior) or list(self.engine.acceptance.alphas)
        spec = RequestState(Acceptance(prior, self.engine.policy.cfg.ewma_weight), mode,
                            fixed_gamma=gamma)
        return Handle(request.request_id or uuid.uuid4().hex, seq, spec, gamma_limit=gamma)
