"""`outrider target-worker`: one target replica (a TP group) as a gRPC server."""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from outrider.target_worker.scheduler import SchedulerConfig

from outrider.core.policy import MAX_GAMMA, MAX_QUEUED_PER_REPLICA, GammaPolicy, PolicyConfig
from outrider.core.sequence import NGRAM_SIZES, ProposerKind
from outrider.cpus import on_a_passing_thread
from outrider.flags import (
    add_cpus_arg,
    add_max_model_len_arg,
    add_metrics_arg,
    add_model_server_args,
    add_proposer_arg,
    add_quantization_arg,
    add_self_draft_arg,
    add_tree_args,
    check_self_draft,
    ngram_sizes_of_args,
    resolve_device,
)
from outrider.v1.worker_pb2 import DESCRIPTOR

# the engine (torch) is imported in start(): `outrider serve`, outrider.local_system and the
# cluster spec read this module's config and flags
if TYPE_CHECKING:
    from outrider.engine.runner import RunnerConfig
    from outrider.grpc_server import Running

SERVICE_NAME = DESCRIPTOR.services_by_name["Target"].full_name


@dataclass(frozen=True)
class TargetWorkerConfig:
    runner: RunnerConfig
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    draft_addresses: tuple[str, ...] = ()
    gamma: int = 4                 # FIXED requests' γ and AUTO requests' γ_max by default
    host: str = "127.0.0.1"
    port: int = 0
    dist_address: str | None = None
    overlap_max_seqs: int = 2
    hot_heat: float = PolicyConfig.hot_heat
    cool_heat: float = PolicyConfig.cool_heat
    metrics_port: int | None = None  # Prometheus exposition; None: off, 0: a free port
    auto_gamma_max: int = PolicyConfig.gamma_max  # AUTO requests' γ cap when they set none
    proposer: ProposerKind = ProposerKind.AUTO  # requests' proposer when they name none
    draft_head: str | None = None  # a head's checkpoint dir: it drafts in this process,
    #                                or on the draft replicas when they are given
    tree_topk: int = 1             # token trees (engine/tree.py; 1: chains)
    tree_tokens: int = 0
    # self-speculation: the target's own layers draft ("auto" or "0,1,5"; layer_skip.py)
    self_draft_layers: str | None = None
    ngram_sizes: tuple[int, int] = NGRAM_SIZES  # the n-gram lookup's matches

    def __post_init__(self) -> None:
        for name in ("gamma", "auto_gamma_max"):
            if not 0 <= getattr(self, name) <= MAX_GAMMA:
                raise ValueError(f"{name} must be in [0, {MAX_GAMMA}], got "
                                 f"{getattr(self, name)}")
        if self.overlap_max_seqs < 0:
            raise ValueError("overlap_max_seqs must be >= 0")
        PolicyConfig(MAX_GAMMA, self.hot_heat, self.cool_heat)  # validates the heats
        check_self_draft(self.self_draft_layers, "--draft-address and --draft-head",
                         self.draft_addresses, self.draft_head)
        if self.tree.topk > 1 and (self.draft_addresses
                                   or not (self.draft_head or self.self_draft_layers)):
            raise ValueError("--tree-topk > 1 needs --draft-head without --draft-address, or "
                             "--self-draft-layers: draft replicas propose chains")

    @property
    def tree(self):
        from outrider.engine.tree import TreeShape

        return TreeShape(self.tree_topk, self.tree_tokens)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TargetWorkerConfig:
        """From `outrider target-worker`'s flags (add_arguments)."""
        from outrider.engine.runner import RunnerConfig

        runner = RunnerConfig(model_dir=args.model, device=resolve_device(args.device),
                              dtype=args.dtype, max_model_len=args.max_model_len,
                              tp=args.tp, kv_cache_mb=args.kv_cache_mb,
                              memory_utilization=args.gpu_memory_utilization,
                              max_num_seqs=args.max_num_seqs, threads=args.threads,
                              small_step_threads=args.small_step_threads,
                              step_threads=args.step_threads,
                              prefix_caching=args.enable_prefix_caching,
                              compile=args.compile, enforce_eager=args.enforce_eager,
                              prepared_rows=args.max_batch_tokens,
                              quantization=args.quantization)
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                max_batch_tokens=args.max_batch_tokens)
        return cls(runner, sched, tuple(args.draft_address), args.gamma, args.host, args.port,
                   args.draft_dist_address, args.overlap_max_seqs, args.hot_heat,
                   args.cool_heat, args.metrics_port, args.auto_gamma_max,
                   ProposerKind.parse(args.proposer, "--proposer"), args.draft_head,
                   args.tree_topk, args.tree_tokens, args.self_draft_layers,
                   ngram_sizes_of_args(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`outrider target-worker`'s flags (TargetWorkerConfig.from_args reads them)."""
    from outrider.engine.runner import SMALL_STEP_TOKENS, STEP_THREADS, RunnerConfig

    p.add_argument("--model", required=True, help="target checkpoint dir")
    p.add_argument("--draft-address", action="append", default=[],
                   help="host:port of a draft replica (repeat for several)")
    p.add_argument("--draft-head",
                   help="a draft head's checkpoint dir (EAGLE-3, EAGLE-1 or Medusa, the "
                        "layouts vLLM and SGLang load): it drafts in this process, on the "
                        "target's device, from the target's hidden states; with "
                        "--draft-address, the replicas there run it (EAGLE-3, EAGLE-1) and "
                        "the features go with each Propose")
    p.add_argument("--draft-dist-address",
                   help="host:port to host a dense q channel (torch.distributed) with "
                        "the first draft replica, when it runs on this machine")
    p.add_argument("--gamma", type=int, default=TargetWorkerConfig.gamma,
                   help="γ of FIXED requests that set none")
    p.add_argument("--auto-gamma-max", type=int, default=TargetWorkerConfig.auto_gamma_max,
                   help="the most γ the policy may choose for AUTO requests that set "
                        "no gamma_max")
    p.add_argument("--hot-heat", type=float, default=TargetWorkerConfig.hot_heat,
                   help="batch heat at which AUTO speculation turns off")
    p.add_argument("--cool-heat", type=float, default=TargetWorkerConfig.cool_heat,
                   help="batch heat at which it turns back on (hysteresis)")
    p.add_argument("--overlap-max-seqs", type=int, default=TargetWorkerConfig.overlap_max_seqs,
                   help="draft round r+1 while round r verifies when at most this many "
                        "sequences speculate (0: never; it pays in small batches)")
    add_proposer_arg(p)
    add_self_draft_arg(p)
    add_quantization_arg(p)
    add_tree_args(p)
    p.add_argument("--tp", "--tensor-parallel-size", type=int, default=RunnerConfig.tp,
                   help="tensor-parallel degree (ranks, one process each)")
    add_model_server_args(p, host=TargetWorkerConfig.host, port=TargetWorkerConfig.port,
                          device="auto", dtype=RunnerConfig.dtype,
                          threads=RunnerConfig.threads,
                          threads_help="CPU threads per rank (0: the cores it may use, "
                                       "shared out over --tp)")
    p.add_argument("--small-step-threads", type=int, default=RunnerConfig.small_step_threads,
                   help="CPU threads of a small forward (--step-threads), leaving the "
                        "other cores to a draft replica drafting beside it and the router "
                        "(0: --threads; `outrider serve` on a CPU sets the target's own "
                        "cores)")
    p.add_argument("--step-threads", choices=STEP_THREADS, default=RunnerConfig.step_threads,
                   help=f"which forwards are small: fewer than {SMALL_STEP_TOKENS} tokens, "
                        "and with by-kind every decode step (one token a sequence)")
    add_max_model_len_arg(p)
    add_cpus_arg(p)
    add_batch_arguments(p)
    add_metrics_arg(p)


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduler's budget (`outrider serve` takes them too, for its target)."""
    p.add_argument("--max-batch-tokens", "--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_batch_tokens,
                   help="target positions per step, draft tokens and prefill chunks included")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="sequences one step may hold")


def serve(cfg: TargetWorkerConfig, token: str | None) -> None:
    """`outrider target-worker`: start, then run until signalled."""
    from outrider.grpc_server import serve_until_signalled

    serve_until_signalled(start(cfg, token), "target worker")


def runner_config(cfg: TargetWorkerConfig) -> RunnerConfig:
    """The target's runner; with a head, its cached prefixes keep the head's features."""
    if not cfg.draft_head:
        return cfg.runner
    from outrider.engine.heads import head_feature_width

    return replace(cfg.runner,
                   feature_width=head_feature_width(cfg.draft_head, cfg.runner.model_dir))


def remote_head(cfg: TargetWorkerConfig, runner):
    """The target's side of a head its draft replicas run (None: they run a model)."""
    if not cfg.draft_head:
        return None
    from outrider.core.hf_config import ModelConfigError, head_kind
    from outrider.engine.heads import RemoteHead

    if head_kind(cfg.draft_head) == "medusa":
        raise ModelConfigError(f"{cfg.draft_head}: Medusa heads draft in the target's "
                               f"process (--draft-head without --draft-address)")
    return RemoteHead(cfg.draft_head, runner)


@on_a_passing_thread
def start(cfg: TargetWorkerConfig, token: str | None, tp_init_method: str | None = None,
          spawn_ranks: bool = True) -> Running:
    """Start the replica; with spawn_ranks=False its TP ranks 1.. are started elsewhere
    (Ray actors) and join at `tp_init_method`. Its forwards run on the engine thread
    alone once started (on_a_passing_thread: why)."""
    from outrider.target_worker.cost import measure_cost_model
    from outrider.target_worker.engine import TargetEngine
    from outrider.target_worker.remote_drafter import RemoteDrafter
    from outrider.target_worker.service import TargetService

    from outrider import cluster_tls
    from outrider.core.tokenizer import vocab_fingerprint
    from outrider.dense_channel import TARGET_RANK, DenseChannel
    from outrider.engine.distributed import TPRunnerGroup
    from outrider.engine.mix import ProposerMix
    from outrider.engine.spec_decode import SpeculativeDecoder
    from outrider.grpc_server import Running, build_server
    from outrider.telemetry.metrics import TargetMetrics, serve_metrics
    from outrider.telemetry.tracing import setup_tracing
    from outrider.v1 import worker_pb2_grpc

    setup_tracing("outrider-target")
    credentials = cluster_tls.server_credentials()  # before loading: a bad setup fails fast
    group = TPRunnerGroup(runner_config(cfg), tp_init_method, spawn_ranks)
    channel = DenseChannel(cfg.dist_address, TARGET_RANK) if cfg.dist_address else None
    if channel and not channel.wait_ready(timeout_s=60):
        print("dense q channel did not come up; full-vocabulary q goes as fp16 over gRPC",
              file=sys.stderr, flush=True)
    vocab = vocab_fingerprint(cfg.runner.model_dir)
    drafter = (RemoteDrafter(list(cfg.draft_addresses), token,
                             seq_prefix=f"{uuid.uuid4().hex[:8]}:", dense_channel=channel,
                             head=remote_head(cfg, group.runner),
                             target_vocab=vocab)
               if cfg.draft_addresses else None)
    if cfg.draft_head and not cfg.draft_addresses:
        from outrider.engine.heads import head_proposer

        # a head's one layer holds as many positions as the target's cache in a share of it
        share = 2 / group.runner.model_config.num_layers
        drafter = head_proposer(replace(cfg.runner, model_dir=cfg.draft_head,
                                        kv_cache_mb=group.runner.kv_cache_mb * share,
                                        prepared_rows=0, quantization=None), group.runner)
    if cfg.self_draft_layers:
        from outrider.engine.layer_skip import layer_skip_proposer

        drafter = layer_skip_proposer(cfg.runner, group.runner, cfg.self_draft_layers)
    proposer = ProposerMix(drafter, group.runner.vocab_size, cfg.proposer,
                           ngram_sizes=cfg.ngram_sizes)
    decoder = SpeculativeDecoder(group.runner, proposer, overlap_max_seqs=cfg.overlap_max_seqs,
                                 tree=cfg.tree)
    cost = measure_cost_model(group.runner, drafter, cfg.sched.max_batch_tokens)
    policy = GammaPolicy(PolicyConfig(MAX_GAMMA, cfg.hot_heat, cfg.cool_heat), cost,
                         width=decoder.verify_width)
    metrics = TargetMetrics(group.runner.model_name)
    engine = TargetEngine(decoder, cfg.sched, policy, metrics)
    # trees or chains, priced by the cost model the replica keeps true (engine/tree.py)
    decoder.verify_seconds = lambda n: float(engine.policy.cost.verify_seconds(n))
    metrics.watch_load(engine.load)
    metrics.watch_prefix_cache(group.runner.blocks)
    metrics.watch_referee(engine.policy.referee)
    metrics_port = (0 if cfg.metrics_port is None else
                    serve_metrics(cfg.host, cfg.metrics_port, "target worker", tries=16))
    speculates = drafter is not None or cfg.proposer is not ProposerKind.MODEL
    service = TargetService(engine, default_gamma=cfg.gamma if speculates else 0,
                            auto_gamma_max=cfg.auto_gamma_max if speculates else 0,
                            metrics_port=metrics_port, target_vocab=vocab)
    # every open stream holds a handler thread, waiting ones too: room for a full batch,
    # the queue a router may build (ServiceLimits.max_waiting) and the control calls
    # (GetLoad, Cancel), which must stay answerable under load or routers drop a
    # healthy replica
    server, bound = build_server(
        lambda s: worker_pb2_grpc.add_TargetServicer_to_server(service, s),
        [SERVICE_NAME], f"{cfg.host}:{cfg.port}", token,
        max_workers=cfg.sched.max_num_seqs + MAX_QUEUED_PER_REPLICA + 16,
        credentials=credentials)
    # what start-up built (the model, its caches, the cost runs) lives as long as the
    # replica: kept out of the cyclic collector's full passes, which then scan only what
    # steps allocate
    gc.freeze()
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,), name="target-engine", daemon=True)
    loop.start()
    server.start()

    def close() -> None:  # after the streams in flight drained, the engine stops
        stop.set()
        loop.join(timeout=10)
        group.close()
        if cfg.draft_addresses:  # (a head in this process holds no connection)
            drafter.close()
    return Running(server, f"{cfg.host}:{bound}", [close], service)
