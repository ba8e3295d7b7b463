"""The models one router serves, each on its own target replicas (docs/DESIGN.md §9.2).

A router may serve several targets, of one tokenizer or of many: a request names its model
(`GenerateRequest.model`, HTTP's `model`), and goes to a `GenerationService` of that
model, which picks among that model's replicas only. The replicas themselves are one
ReplicaSet (one heartbeat, one stream per replica); a replica belongs to a model by the
vocabulary it reports (`Load.target_vocab`: a token id means nothing in another
vocabulary) and by its checkpoint's name (`Load.model_pair`)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from outrider.router.refusal import Refused
from outrider.router.replicas import ReplicaSet
from outrider.router.service import GenerationService, _abort, replica_rows

from outrider.core.hf_config import checkpoint_name
from outrider.core.load import pair_target
from outrider.core.tokenizer import vocab_fingerprint
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc
from outrider.v1 import worker_pb2 as pb


@dataclass(frozen=True)
class ModelIdentity:
    """What tells a model's replicas apart from the other models' of the same router."""

    name: str                # its dir's name, as its replicas name it (core.load.model_pair)
    vocab: str               # its vocab_fingerprint

    @classmethod
    def of(cls, model_dir: str) -> ModelIdentity:
        return cls(checkpoint_name(model_dir), vocab_fingerprint(model_dir))

    def serves(self, load: pb.Load) -> bool:
        """Whether a replica reporting `load` serves this model: its vocabulary (when it
        reports one: replicas before it did not) and its checkpoint's name are this
        model's. The name too, since two checkpoints of one tokenizer (a base model and
        its fine-tune, served by routers sharing a registry) are different models."""
        if load.target_vocab and load.target_vocab != self.vocab:
            return False
        return pair_target(load.model_pair) == self.name


@dataclass(frozen=True)
class ServedModel:
    """One model of the router: its id, its service, and what the HTTP API needs of it."""

    name: str                   # the id requests name and /v1/models lists
    service: GenerationService  # over the router's replicas that serve it (its `serves`)
    chat_template: object = None  # router.chat_template.ChatTemplate, or None: none

    def take(self, request: gp.GenerateRequest) -> GenerationService:
        """Its service, the request naming the model from now on (gRPC and HTTP alike): a
        retry naming it and one naming none are the same request to the journal."""
        request.model = self.name
        return self.service


class Models(generate_pb2_grpc.GenerationServicer):
    """The router's models by id, the first the default (a request naming none); the
    gRPC Generation service, each request handed to its model's service."""

    def __init__(self, served: list[ServedModel], replicas: ReplicaSet) -> None:
        if not served:
            raise ValueError("a router serves at least one model")
        names = [m.name for m in served]
        if len(set(names)) != len(names):
            raise ValueError(f"two served models have one id: {names} (give each its own "
                             "--served-model-name)")
        self.served = {m.name: m for m in served}
        self.default = served[0]
        self.replicas = replicas

    def __iter__(self):
        return iter(self.served.values())

    def named(self, name: str | None) -> ServedModel:
        """The model `name` (None or empty: the default); NOT_FOUND naming those served."""
        if not name:
            return self.default
        if name not in self.served:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"model {name!r} does not exist; this "
                          f"router serves {', '.join(map(repr, self.served))} "
                          "(see /v1/models)")
        return self.served[name]

    def live(self) -> list:
        """The live replicas of any of the router's models (not those of other routers'
        models in a shared registry): health, Status and /metrics count these."""
        return self.replicas.live(lambda load: any(m.service.serves(load) for m in self))

    # -- the gRPC Generation service ----------------------------------------------------
    def GenerateStream(self, request: gp.GenerateRequest, context):
        yield from self._service(request, context).GenerateStream(request, context)

    def Generate(self, request: gp.GenerateRequest, context) -> gp.GenerateResponse:
        return self._service(request, context).Generate(request, context)

    def Status(self, request: gp.StatusRequest, context) -> gp.RouterStatus:
        """The default model's status (the shared statistics) with every model's replicas."""
        status = self.default.service.Status(request, context)
        if len(self.served) > 1:  # (the default's rows are one model's)
            del status.replicas[:]
            status.replicas.extend(replica_rows(self.live()))
        return status

    def _service(self, request: gp.GenerateRequest, context) -> GenerationService:
        try:
            return self.named(request.model).take(request)
        except Refused as refusal:
            self.default.service.telemetry.metrics.answered(refusal.code.name, "grpc")
            _abort(context, refusal)
