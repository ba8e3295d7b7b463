"""`outrider draft-worker`: one draft replica as a gRPC server."""

from __future__ import annotations

from outrider.draft_worker.service import DraftService

from outrider import cluster_tls
from outrider.cpus import available_cpus, parse_cpus
from outrider.dense_channel import DRAFT_RANK, DenseChannel
from outrider.engine.distributed import set_cpu_threads
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.grpc_server import Running, build_server, serve_until_signalled
from outrider.telemetry.metrics import DraftMetrics, serve_metrics
from outrider.telemetry.tracing import setup_tracing
from outrider.v1 import worker_pb2_grpc
from outrider.v1.worker_pb2 import DESCRIPTOR

SERVICE_NAME = DESCRIPTOR.services_by_name["Draft"].full_name


def serve(*args, **kwargs) -> None:
    """`outrider draft-worker`: start, then run until signalled."""
    serve_until_signalled(start(*args, **kwargs), "draft worker")


def start(model_dir: str, host: str, port: int, token: str | None, device: str = "cpu",
          dtype: str = "auto", kv_cache_mb: float = 256.0, idle_ttl_s: float = 300.0,
          dist_address: str | None = None, threads: int = 0,
          metrics_port: int | None = None, target_cpus: str | None = None) -> None:
    setup_tracing("outrider-draft")
    credentials = cluster_tls.server_credentials()  # before loading: a bad setup fails fast
    cfg = RunnerConfig(model_dir, device=device, dtype=dtype, kv_cache_mb=kv_cache_mb,
                       threads=threads)
    set_cpu_threads(cfg)
    runner = ModelRunner(cfg)
    channel = DenseChannel(dist_address, DRAFT_RANK) if dist_address else None
    metrics = DraftMetrics(runner.model_name)
    metrics.watch_cache(lambda: runner.blocks.num_sequences)
    if metrics_port is not None:
        serve_metrics(host, metrics_port, "draft worker", tries=16)
    cores = None
    if target_cpus:  # (while the target waits, while it verifies)
        shared = parse_cpus(target_cpus)
        cores = (shared, [c for c in available_cpus() if c not in shared] or shared)
    service = DraftService(Drafter(runner, evict_lru=True), idle_ttl_s=idle_ttl_s,
                           dense_channel=channel, metrics=metrics, cores=cores)
    server, bound = build_server(
        lambda s: worker_pb2_grpc.add_DraftServicer_to_server(service, s),
        [SERVICE_NAME], f"{host}:{port}", token,
        credentials=credentials)
    server.start()
    return Running(server, f"{host}:{bound}", service=service)
