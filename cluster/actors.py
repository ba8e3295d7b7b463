"""The Ray actors that host Outrider's roles. Each runs the same server code as the
`outrider <role>` commands, in its own worker process, placed by the controller.

A target replica is a placement group of tp bundles: TargetRank actors hold ranks 1..,
the TargetDriver holds rank 0 and serves gRPC. They meet in torch.distributed at the
driver's address (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

import dataclasses
import os
import threading

import ray

from outrider.engine.distributed import run_tp_rank
from outrider.engine.runner import RunnerConfig
from outrider.launch import free_port


def where() -> dict:
    """Where this actor runs: node, device, process and its resident memory."""
    ctx = ray.get_runtime_context()
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "device": f"cuda:{gpus}" if gpus else "cpu", "pid": os.getpid(),
            "rss_mb": _rss_mb()}


def advertised(host: str, address: str) -> str:
    """The address others dial: the node's IP when listening on every interface."""
    port = address.rsplit(":", 1)[1]
    return f"{ray.util.get_node_ip_address()}:{port}" if host == "0.0.0.0" else address


class _Replica:
    running = None
    host = "127.0.0.1"

    def ping(self) -> bool:
        return True

    def where(self) -> dict:
        return where()

    def address(self) -> str:
        return advertised(self.host, self.running.address)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.running is not None:
            self.running.stop(grace_s)
            self.running = None


class DraftReplica(_Replica):
    def __init__(self, runner: RunnerConfig, host: str, port: int, token: str,
                 metrics_port: int | None = None, adapt: bool = False,
                 adapt_redis: str | None = None, adapt_pair: str | None = None,
                 target_model: str | None = None, speculation_cache: bool = False,
                 cache_aware_sampling: float | None = None) -> None:
        from outrider.draft_worker.main import DraftWorkerConfig, start

        self.host = host
        self.running = start(DraftWorkerConfig(runner.model_dir, host, port,
                                               device=runner.device, dtype=runner.dtype,
                                               kv_cache_mb=runner.kv_cache_mb,
                                               memory_utilization=runner.memory_utilization,
                                               threads=runner.threads,
                                               metrics_port=metrics_port,
                                               prefix_caching=runner.prefix_caching,
                                               compile=runner.compile,
                                               enforce_eager=runner.enforce_eager,
                                               adapt=adapt, adapt_redis=adapt_redis,
                                               adapt_pair=adapt_pair,
                                               target_models=(target_model,) if target_model
                                               else (),
                                               speculation_cache=speculation_cache,
                                               cache_aware_sampling=cache_aware_sampling),
                             token)
        self.service = self.running.service

    def busy_seconds(self) -> float:
        """Seconds spent drafting so far (the autoscaler's load signal)."""
        return self.service.draft_seconds_total


class TargetRank:
    """Rank 1.. of a target replica: joins the group and follows rank 0's forwards."""

    def __init__(self, runner: RunnerConfig, rank: int, init_method: str) -> None:
        self.thread = threading.Thread(target=run_tp_rank, args=(runner, rank, init_method),
                                       name=f"tp-rank-{rank}", daemon=True)
        self.thread.start()

    def ping(self) -> bool:
        if not self.thread.is_alive():
            raise RuntimeError("the rank's loop ended")
        return True

    def where(self) -> dict:
        return where()


class TargetDriver(_Replica):
    """Rank 0 of a target replica: the gRPC service, the engine loop, the γ policy."""

    def init_method(self) -> str:
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('0.0.0.0')}"

    def start(self, cfg, token: str, init_method: str) -> str:
        """Start the replica (returns its address once ranks 1.. have joined)."""
        from outrider.target_worker.main import start

        self.host = cfg.host
        self.running = start(cfg, token, init_method, spawn_ranks=cfg.runner.tp == 1)
        return self.address()

    def ping(self) -> bool:
        if self.running is not None and self.running.service.engine.broken:
            raise RuntimeError(self.running.service.engine.broken)
        return True

    def load(self) -> dict:
        return dataclasses.asdict(self.running.service.engine.load())


class RouterReplica(_Replica):
    def __init__(self, cfg, token: str) -> None:
        from outrider.router.main import start

        self.host = cfg.host
        self.running = start(cfg, token)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
