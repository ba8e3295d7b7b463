"""`outrider draft-worker`: one draft replica as a gRPC server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from outrider.draft_worker.adapt import Adapter
from outrider.draft_worker.service import DraftService
from outrider.draft_worker.versions import SharedVersions

from outrider import cluster_tls
from outrider.core.hf_config import ModelConfigError, head_kind
from outrider.core.tokenizer import vocab_fingerprint
from outrider.cpus import available_cpus, on_a_passing_thread, parse_cpus
from outrider.dense_channel import DRAFT_RANK, DenseChannel
from outrider.engine.cross_vocab import across_vocabularies
from outrider.engine.distill import DistillConfig
from outrider.engine.distributed import set_cpu_threads
from outrider.engine.drafter import Drafter
from outrider.engine.heads import HeadRunner, TargetSide
from outrider.engine.model_config import ModelConfig
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import RequestError
from outrider.flags import (
    add_cpus_arg,
    add_metrics_arg,
    add_model_server_args,
    resolve_device,
    unit_share,
)
from outrider.grpc_server import Running, build_server, serve_until_signalled
from outrider.state import RedisStore
from outrider.telemetry.metrics import DraftMetrics, serve_metrics
from outrider.telemetry.tracing import setup_tracing
from outrider.v1 import worker_pb2_grpc
from outrider.v1.worker_pb2 import DESCRIPTOR

SERVICE_NAME = DESCRIPTOR.services_by_name["Draft"].full_name
# a head's Propose carries a feature row a new token: a new 8K-token context of an 8B
# target is 64 MiB in bf16
PROPOSE_MAX_MB = 1024


@dataclass(frozen=True)
class DraftWorkerConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = RunnerConfig.device
    dtype: str = RunnerConfig.dtype
    kv_cache_mb: float | None = RunnerConfig.kv_cache_mb  # None: sized from memory
    memory_utilization: float | None = None  # RunnerConfig's
    idle_ttl_s: float = 300.0          # idle sequences are freed (they MISS later)
    dist_address: str | None = None    # the co-located target's dense q channel
    threads: int = RunnerConfig.threads
    metrics_port: int | None = None    # Prometheus exposition; None: off, 0: a free port
    target_cpus: str | None = None     # a co-located target's cores (overlap)
    prefix_caching: bool = RunnerConfig.prefix_caching
    compile: bool = RunnerConfig.compile
    enforce_eager: bool = RunnerConfig.enforce_eager
    prepared_rows: int = 512           # its forwards: a row per drafting sequence, and
    #                                    the context's new tokens (RunnerConfig)
    adapt: bool = False                # online distillation on the traffic it drafts for
    distill: DistillConfig = DistillConfig()
    adapt_redis: str | None = None     # share versions: one replica of the pair trains
    adapt_pair: str | None = None      # the pair's name there (default: the draft's)
    # the targets it drafts for: a head's (its embedding and lm_head); targets of another
    # vocabulary than the draft's get the target's tokens through text (cross_vocab.py)
    target_models: tuple[str, ...] = ()
    speculation_cache: bool = False    # draft the next round while the target verifies
    cache_aware_sampling: float | None = None  # sampled rows too, q shaped (spec_cache.py)

    @property
    def target_model(self) -> str | None:
        return self.target_models[0] if self.target_models else None

    def __post_init__(self) -> None:
        if self.cache_aware_sampling is not None and not self.speculation_cache:
            raise ValueError("--cache-aware-sampling prepares sampled rows in the "
                             "speculation cache: it needs --speculation-cache")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DraftWorkerConfig:
        """From `outrider draft-worker`'s flags (add_arguments)."""
        return cls(args.model, args.host, args.port, device=resolve_device(args.device),
                   dtype=args.dtype,
                   kv_cache_mb=args.kv_cache_mb,
                   memory_utilization=args.gpu_memory_utilization, idle_ttl_s=args.idle_ttl_s,
                   dist_address=args.dist_address, threads=args.threads,
                   metrics_port=args.metrics_port, target_cpus=args.target_cpus,
                   prefix_caching=args.enable_prefix_caching, compile=args.compile,
                   enforce_eager=args.enforce_eager,
                   adapt=args.adapt,
                   distill=DistillConfig(round_tokens=args.adapt_round_tokens,
                                         max_duty=args.adapt_max_duty),
                   adapt_redis=args.adapt_redis, adapt_pair=args.adapt_pair,
                   target_models=tuple(args.target_model or ()),
                   speculation_cache=args.speculation_cache,
                   cache_aware_sampling=args.cache_aware_sampling)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`outrider draft-worker`'s flags (DraftWorkerConfig.from_args reads them)."""
    p.add_argument("--model", required=True,
                   help="draft checkpoint dir: a draft model, or an EAGLE-3 / EAGLE-1 head "
                        "(the target sends its features with each Propose)")
    p.add_argument("--target-model", metavar="DIR", action="append",
                   help="a target's checkpoint dir: a head's embedding (and lm_head where "
                        "the head has none); a draft model proposes in the ids of each "
                        "target named (repeat the flag), through text for one of another "
                        "tokenizer; nothing else of it is loaded")
    cfg = DraftWorkerConfig
    add_model_server_args(p, host=cfg.host, port=cfg.port, device="auto", dtype=cfg.dtype,
                          threads=cfg.threads,
                          threads_help="CPU threads (0: one per core it may use)")
    add_cpus_arg(p)
    p.add_argument("--target-cpus",
                   help="cores of a target replica on this machine: the draft drafts "
                        "on them while the target waits for it, and on the other cores "
                        "while the target verifies (overlap)")
    p.add_argument("--idle-ttl-s", type=float, default=DraftWorkerConfig.idle_ttl_s,
                   help="free sequences idle this long (they MISS later)")
    p.add_argument("--dist-address", help="host:port of the co-located target's dense "
                                          "q channel (torch.distributed, gloo on CPU)")
    p.add_argument("--speculation-cache", action=argparse.BooleanOptionalAction,
                   default=DraftWorkerConfig.speculation_cache,
                   help="while the target verifies a round, draft the next one for its "
                        "likely outcomes, so that a Propose that brings one is answered at "
                        "once (greedy chains of a draft model; not with --adapt; off: on "
                        "two shared cores it costs more than it saves: docs/DESIGN.md §2.6)")
    p.add_argument("--cache-aware-sampling", type=unit_share, metavar="WEIGHT",
                   help="the cache prepares sampled rows too, their drafts sampled from a q "
                        "whose 4 likeliest tokens keep WEIGHT of their probability, so that "
                        "where the target rejects a draft it mostly draws a token the cache "
                        "prepared for (exact for any WEIGHT in (0, 1]; default: greedy rows "
                        "only)")
    p.add_argument("--adapt", action="store_true",
                   help="online distillation: train the draft on the target's tokens of "
                        "the sequences it drafts for, and adopt the trained weights when "
                        "they agree with the target more on held-out traffic (default: off)")
    p.add_argument("--adapt-round-tokens", type=int, default=DistillConfig.round_tokens,
                   help="new output tokens served between training rounds")
    p.add_argument("--adapt-max-duty", type=float, default=DistillConfig.max_duty,
                   help="at most this share of wall time spent training")
    p.add_argument("--adapt-redis", metavar="URL",
                   help="redis://host:port/db shared by the pair's draft replicas: one "
                        "trains and publishes versions there, the others pull them")
    p.add_argument("--adapt-pair", metavar="NAME",
                   help="the model pair's name in --adapt-redis (default: the draft "
                        "model's name)")
    add_metrics_arg(p)


def serve(cfg: DraftWorkerConfig, token: str | None) -> None:
    """`outrider draft-worker`: start, then run until signalled."""
    serve_until_signalled(start(cfg, token), "draft worker")


def proposers_of(drafter: Drafter, cfg: DraftWorkerConfig) -> dict:
    """The proposer for each target's vocabulary (vocab_fingerprint; "": the first
    target's, for a target that does not say): the drafter where the vocabulary is its
    own, the drafter proposing through text where it is not (engine/cross_vocab.py).
    Without --target-model, or for a head, the drafter for every target."""
    if not cfg.target_models or head_kind(cfg.model_dir):
        return {"": drafter}
    proposers = {}
    for target in cfg.target_models:
        try:
            proposer = across_vocabularies(drafter, target, cfg.model_dir,
                                           ModelConfig.from_dir(target).vocab_size)
        except RequestError as exc:
            raise ModelConfigError(str(exc)) from None
        if proposer is not drafter and (cfg.speculation_cache or cfg.adapt):
            raise ModelConfigError(f"{cfg.model_dir} has another vocabulary than {target}: "
                                   f"it proposes through text, without --speculation-cache "
                                   f"or --adapt")
        proposers[vocab_fingerprint(target)] = proposer
    return {"": next(iter(proposers.values())), **proposers}


def draft_runner(runner_cfg: RunnerConfig, cfg: DraftWorkerConfig) -> ModelRunner:
    """The draft model's runner, or a head's beside its target's embedding and lm_head."""
    kind = head_kind(cfg.model_dir)
    if not kind:
        return ModelRunner(runner_cfg)
    if kind == "medusa":
        raise ModelConfigError(f"{cfg.model_dir}: Medusa heads draft in the target's process "
                               f"(target-worker --draft-head), not on draft replicas")
    if not cfg.target_model:
        raise ModelConfigError(f"{cfg.model_dir} is an {kind} head: --target-model DIR "
                               f"(the target's checkpoint) gives it the target's embedding")
    if cfg.adapt:
        raise ModelConfigError("--adapt trains draft models, not heads")
    return HeadRunner(runner_cfg, TargetSide.from_checkpoint(
        replace(runner_cfg, model_dir=cfg.target_model, prepared_rows=0)))


@on_a_passing_thread
def start(cfg: DraftWorkerConfig, token: str | None) -> Running:
    setup_tracing("outrider-draft")
    credentials = cluster_tls.server_credentials()  # before loading: a bad setup fails fast
    runner_cfg = RunnerConfig(cfg.model_dir, device=cfg.device, dtype=cfg.dtype,
                              kv_cache_mb=cfg.kv_cache_mb,
                              memory_utilization=cfg.memory_utilization, threads=cfg.threads,
                              prefix_caching=cfg.prefix_caching, compile=cfg.compile,
                              enforce_eager=cfg.enforce_eager, prepared_rows=cfg.prepared_rows)
    set_cpu_threads(runner_cfg)
    runner = draft_runner(runner_cfg, cfg)
    channel = DenseChannel(cfg.dist_address, DRAFT_RANK) if cfg.dist_address else None
    metrics = DraftMetrics(runner.model_name)
    metrics.watch_cache(lambda: runner.blocks.num_sequences, runner.blocks)
    if cfg.metrics_port is not None:
        serve_metrics(cfg.host, cfg.metrics_port, "draft worker", tries=16)
    cores = None
    if cfg.target_cpus:  # (while the target waits, while it verifies)
        shared = parse_cpus(cfg.target_cpus)
        cores = (shared, [c for c in available_cpus() if c not in shared] or shared)
    drafter = Drafter(runner, evict_lru=True)
    metrics.watch_version(lambda: drafter.version)
    service = DraftService(drafter, proposers_of(drafter, cfg), idle_ttl_s=cfg.idle_ttl_s,
                           dense_channel=channel,
                           metrics=metrics, cores=cores,
                           speculation_cache=cfg.speculation_cache and cfg.prefix_caching,
                           sampled_weight=cfg.cache_aware_sampling)
    if cfg.adapt:
        shared = None
        if cfg.adapt_redis:
            shared = SharedVersions(RedisStore(cfg.adapt_redis, timeout_s=10.0),
                                    cfg.adapt_pair or runner.model_name)
        service.adapter = Adapter(drafter, service.lock, cfg.distill, metrics.adapt_round,
                                  shared, metrics.rollbacks.inc)
        metrics.watch_training(lambda: service.adapter.is_training)
        metrics.watch_trainer(lambda: service.adapter.is_trainer)
        service.adapter.start()
    server, bound = build_server(
        lambda s: worker_pb2_grpc.add_DraftServicer_to_server(service, s),
        [SERVICE_NAME], f"{cfg.host}:{cfg.port}", token,
        credentials=credentials, max_message_mb=PROPOSE_MAX_MB)
    server.start()
    return Running(server, f"{cfg.host}:{bound}", service=service)
