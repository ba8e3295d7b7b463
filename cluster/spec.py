"""The cluster spec (`outrider up -f SPEC.yaml`): what runs where. Validated with pydantic;
every error names the key, e.g. `spec.yaml: models.0.tp: Input should be greater than
or equal to 1`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from outrider.router.replicas import ROUTING
from outrider.router.service import ServiceLimits
from outrider.target_worker.main import TargetWorkerConfig
from outrider.target_worker.scheduler import SchedulerConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from outrider.core.hf_config import checkpoint_name, head_kind
from outrider.core.policy import MAX_GAMMA, PolicyConfig
from outrider.core.sequence import ProposerKind

Port = Annotated[int, Field(ge=0, le=65535)]
MAX_PAIRS = 8  # models one cluster (its one router) serves


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """What one replica (one TP rank, for targets) asks of Ray."""

    cpus: Annotated[float, Field(ge=0)] = 1.0
    gpus: Annotated[float, Field(ge=0)] = 0.0       # fractional for drafts (e.g. 0.5)
    accelerator_type: str | None = None              # Ray's, e.g. "H100", "L4"
    custom: dict[str, float] = {}                    # custom node resources, e.g. {"l4": 1}

    def ray_options(self) -> dict:
        options: dict = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.custom:
            options["resources"] = dict(self.custom)
        return options

    def bundle(self) -> dict[str, float]:
        """As a placement-group bundle."""
        bundle = {"CPU": self.cpus, **self.custom}
        if self.gpus:
            bundle["GPU"] = self.gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


class Autoscale(_Strict):
    """Draft replicas per target follow the drafts' busy fraction (time spent drafting)."""

    enabled: bool = False
    min_drafts: Annotated[int, Field(ge=1)] = 1
    max_drafts: Annotated[int, Field(ge=1)] = 4
    scale_up_busy: Annotated[float, Field(gt=0, le=1)] = 0.7
    scale_down_busy: Annotated[float, Field(ge=0, lt=1)] = 0.2
    period_s: Annotated[float, Field(gt=0)] = 10.0

    @model_validator(mode="after")
    def _ordered(self) -> Autoscale:
        if self.min_drafts > self.max_drafts:
            raise ValueError("min_drafts must be <= max_drafts")
        if self.scale_down_busy >= self.scale_up_busy:
            raise ValueError("scale_down_busy must be < scale_up_busy")
        return self


class ModelPair(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")]
    target: str                                       # HF checkpoint dir on every node
    draft: str | None = None
    target_replicas: Annotated[int, Field(ge=1)] = 1
    tp: Annotated[int, Field(ge=1, le=64)] = 1
    drafts_per_target: Annotated[int, Field(ge=0)] = 1
    gamma: Annotated[int, Field(ge=0, le=MAX_GAMMA)] = TargetWorkerConfig.gamma  # FIXED γ
    auto_gamma_max: Annotated[int, Field(ge=0, le=MAX_GAMMA)] = (  # AUTO requests' γ cap
        TargetWorkerConfig.auto_gamma_max)
    proposer: ProposerKind = TargetWorkerConfig.proposer  # requests that name none
    # self-speculation: the target's own layers draft ("auto" or "0,1,5"; no draft model)
    self_draft_layers: Annotated[str, Field(pattern=r"^(auto|\d+(,\d+)*)$")] | None = None
    # the n-gram lookup's shortest and longest match (vLLM's prompt_lookup_min/max)
    ngram_sizes: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = (
        TargetWorkerConfig.ngram_sizes)
    device: str = "cpu"                               # "cuda" on GPU clusters
    dtype: str = "auto"
    # the target's, as vLLM's --quantization: fp8 quantizes an unquantized one as it loads
    quantization: Literal["fp8"] | None = None
    kv_cache_mb: Annotated[float, Field(gt=0)] | None = None  # None: sized from memory
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None  # RunnerConfig's
    prefix_caching: bool = True                       # share cached prefixes' KV
    compile: bool = False                             # compiled forwards (compiled.py)
    enforce_eager: bool = False                       # GPU: no CUDA graphs (cuda_graphs.py)
    adapt: bool = False                               # online distillation on the drafts
    speculation_cache: bool = False                   # drafts prepare the next round
    # sampled rows too, their q keeping this share of its 4 likeliest tokens' mass
    cache_aware_sampling: Annotated[float, Field(gt=0, le=1)] | None = None
    max_batch_tokens: Annotated[int, Field(ge=1)] = SchedulerConfig.max_batch_tokens
    max_num_seqs: Annotated[int, Field(ge=1)] = SchedulerConfig.max_num_seqs
    threads: Annotated[int, Field(ge=0)] = 0          # CPU threads per process (0: auto)
    target_metrics_port: Port | None = None           # /metrics of each target (rank 0)
    draft_metrics_port: Port | None = None            # drafts on one node: this, +1, ...
    target_resources: Resources = Resources()         # per TP rank
    draft_resources: Resources = Resources()
    autoscale: Autoscale = Autoscale()

    @model_validator(mode="after")
    def _draft_needs_replicas(self) -> ModelPair:
        if self.draft and self.drafts_per_target < 1:
            raise ValueError("drafts_per_target must be >= 1 when a draft model is given")
        if not self.draft and self.drafts_per_target:
            raise ValueError("drafts_per_target needs a draft model")
        if self.ngram_sizes[0] > self.ngram_sizes[1]:
            raise ValueError(f"ngram_sizes {list(self.ngram_sizes)}: [min, max], min <= max")
        if self.draft and self.self_draft_layers:
            raise ValueError("self_draft_layers: the target drafts with its own layers; "
                             "give no draft")
        if self.self_draft_layers and self.tp > 1:
            raise ValueError("self_draft_layers needs tp 1: the target's layers would be "
                             "split over other ranks' processes")
        if self.cache_aware_sampling is not None and not self.speculation_cache:
            raise ValueError("cache_aware_sampling prepares sampled rows in the speculation "
                             "cache: it needs speculation_cache: true")
        if self.draft and head_kind(self.draft) == "medusa":
            raise ValueError("draft: Medusa heads draft in the target's process; a "
                             "cluster's drafts run on draft replicas (EAGLE-3, EAGLE-1 heads "
                             "and draft models do)")
        return self

    @property
    def draft_is_head(self) -> bool:
        """An EAGLE head drafts on the draft replicas, from the target's features."""
        return bool(self.draft and head_kind(self.draft))


class Policy(_Strict):
    hot_heat: Annotated[float, Field(gt=0)] = PolicyConfig.hot_heat
    cool_heat: Annotated[float, Field(gt=0)] = PolicyConfig.cool_heat
    overlap_max_seqs: Annotated[int, Field(ge=0)] = TargetWorkerConfig.overlap_max_seqs

    @model_validator(mode="after")
    def _hysteresis(self) -> Policy:
        if self.cool_heat >= self.hot_heat:
            raise ValueError("cool_heat must be < hot_heat")
        return self


class RouterSpec(_Strict):
    enabled: bool = True             # false: routers run elsewhere (a Kubernetes Deployment)
    host: str = "127.0.0.1"
    grpc_port: Port = 50051
    http_port: Port | None = 8000
    metrics_port: Port | None = None
    replica_wait_s: Annotated[float, Field(gt=0)] = 60.0  # a request waits this long for
    resources: Resources = Resources(cpus=1)              # a replica (e.g. one restarting)
    max_running_requests: Annotated[int, Field(gt=0)] = (  # more: RESOURCE_EXHAUSTED
        ServiceLimits.max_running)
    routing: Literal[ROUTING] = "cache-aware"          # or "round-robin"


class ClusterSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")] = "outrider"
    redis_url: Annotated[str, Field(pattern=r"^rediss?://")]
    router: RouterSpec = RouterSpec()
    # the router serves every pair's target, the first by default (a request's `model`
    # names the pair); each pair has its own target and draft replicas. Pairs of one
    # target (several drafts for it) are one model, their names aliases: the router sends
    # each request to the replica, so the draft, it expects to serve it soonest
    models: Annotated[list[ModelPair], Field(min_length=1, max_length=MAX_PAIRS)]
    policy: Policy = Policy()
    worker_host: str = "127.0.0.1"   # interface workers listen on ("0.0.0.0" across nodes)
    health_period_s: Annotated[float, Field(gt=0)] = 1.0

    @model_validator(mode="after")
    def _pairs_told_apart(self) -> ClusterSpec:
        targets = list(dict.fromkeys(p.target for p in self.models))  # (one model each)
        pairs = [(p.target, checkpoint_name(p.draft) if p.draft else "") for p in self.models]
        for what, values in (("a name", [p.name for p in self.models]),
                             ("a target dir's name (or the same target)",
                              [checkpoint_name(t) for t in targets]),
                             ("a draft dir's name (among pairs of one target)", pairs)):
            if len(set(values)) != len(values):
                raise ValueError(f"models: each pair needs {what} of its own (the router "
                                 f"tells the models apart by it), got {values}")
        return self

    @property
    def pair(self) -> ModelPair:
        """The first pair: the router's default model."""
        return self.models[0]


class SpecError(ValueError):
    pass


def load_spec(path: str | Path) -> ClusterSpec:
    """The validated spec at `path`; SpecError names the file and the key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SpecError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({exc})") from None
    return parse_spec(raw, str(path))


def parse_spec(raw: object, source: str = "spec") -> ClusterSpec:
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the top level must be a mapping")
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        raise SpecError(f"{source}: {where}: {message}") from None
