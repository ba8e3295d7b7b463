"""`outrider target-worker`: one target replica (a TP group) as a gRPC server."""

from __future__ import annotations

import sys
import threading
import uuid
from dataclasses import dataclass, field

from outrider.router.policy import MAX_GAMMA, GammaPolicy, PolicyConfig
from outrider.target_worker.cost import measure_cost_model
from outrider.target_worker.engine import TargetEngine
from outrider.target_worker.remote_drafter import RemoteDrafter
from outrider.target_worker.scheduler import SchedulerConfig
from outrider.target_worker.service import TargetService

from outrider import cluster_tls
from outrider.dense_channel import TARGET_RANK, DenseChannel
from outrider.engine.distributed import TPRunnerGroup
from outrider.engine.runner import RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.grpc_server import Running, build_server, serve_until_signalled
from outrider.telemetry.metrics import TargetMetrics, serve_metrics
from outrider.telemetry.tracing import setup_tracing
from outrider.v1 import worker_pb2_grpc
from outrider.v1.worker_pb2 import DESCRIPTOR

SERVICE_NAME = DESCRIPTOR.services_by_name["Target"].full_name
ROUTER_QUEUE_ROOM = 256  # = router ServiceLimits.max_waiting


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
    hot_heat: float = 0.9
    cool_heat: float = 0.7
    metrics_port: int | None = None  # Prometheus exposition; None: off, 0: a free port
    auto_gamma_max: int = 8          # AUTO requests' γ cap when they set none

    def __post_init__(self) -> None:
        for name in ("gamma", "auto_gamma_max"):
            if not 0 <= getattr(self, name) <= MAX_GAMMA:
                raise ValueError(f"{name} must be in [0, {MAX_GAMMA}], got "
                                 f"{getattr(self, name)}")
        if self.overlap_max_seqs < 0:
            raise ValueError("overlap_max_seqs must be >= 0")
        PolicyConfig(MAX_GAMMA, self.hot_heat, self.cool_heat)  # validates the heats


def serve(cfg: TargetWorkerConfig, token: str | None) -> None:
    """`outrider target-worker`: start, then run until signalled."""
    serve_until_signalled(start(cfg, token), "target worker")


def start(cfg: TargetWorkerConfig, token: str | None, tp_init_method: str | None = None,
          spawn_ranks: bool = True) -> Running:
    """Start the replica; with spawn_ranks=False its TP ranks 1.. are started elsewhere
    (Ray actors) and join at `tp_init_method`."""
    setup_tracing("outrider-target")
    credentials = cluster_tls.server_credentials()  # before loading: a bad setup fails fast
    group = TPRunnerGroup(cfg.runner, tp_init_method, spawn_ranks)
    channel = DenseChannel(cfg.dist_address, TARGET_RANK) if cfg.dist_address else None
    if channel and not channel.wait_ready(timeout_s=60):
        print("dense q channel did not come up; full-vocabulary q goes as fp16 over gRPC",
              file=sys.stderr, flush=True)
    drafter = (RemoteDrafter(list(cfg.draft_addresses), token,
                             seq_prefix=f"{uuid.uuid4().hex[:8]}:", dense_channel=channel)
               if cfg.draft_addresses else None)
    decoder = SpeculativeDecoder(group.runner, drafter, overlap_max_seqs=cfg.overlap_max_seqs)
    cost = measure_cost_model(group.runner, drafter, cfg.sched.max_batch_tokens)
    policy = GammaPolicy(PolicyConfig(MAX_GAMMA, cfg.hot_heat, cfg.cool_heat), cost)
    metrics = TargetMetrics(group.runner.model_name)
    engine = TargetEngine(decoder, cfg.sched, policy, metrics)
    metrics.watch_load(engine.load)
    if cfg.metrics_port is not None:
        serve_metrics(cfg.host, cfg.metrics_port, "target worker", tries=16)
    service = TargetService(engine, default_gamma=cfg.gamma if drafter else 0,
                            auto_gamma_max=cfg.auto_gamma_max if drafter else 0)
    # every open stream holds a handler thread, waiting ones too: room for a full batch,
    # the queue a router may build (ServiceLimits.max_waiting) and the control calls
    # (GetLoad, Cancel), which must stay answerable under load or routers drop a
    # healthy replica
    server, bound = build_server(
        lambda s: worker_pb2_grpc.add_TargetServicer_to_server(service, s),
        [SERVICE_NAME], f"{cfg.host}:{cfg.port}", token,
        max_workers=cfg.sched.max_num_seqs + ROUTER_QUEUE_ROOM + 16,
        credentials=credentials)
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,), name="target-engine", daemon=True)
    loop.start()
    server.start()

    def close() -> None:  # after the streams in flight drained, the engine stops
        stop.set()
        loop.join(timeout=10)
        group.close()
        if drafter:
            drafter.close()
    return Running(server, f"{cfg.host}:{bound}", [close], service)
