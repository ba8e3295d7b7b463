"""The cluster controller: a named, detached Ray actor that brings the system up from a
ClusterSpec, watches every replica, restarts what dies, scales draft replicas with
their load, and drains everything on shutdown.

    drafts (small GPUs, near their target) → targets (one placement group of tp bundles,
    STRICT_PACK on one large-GPU node) → router(s), which find the targets in Redis.

A restarted draft keeps its port, so its target reconnects by itself; a target replica
restarts whole (a TP group cannot lose a rank) and registers its new address; requests
on it resume on the new one from the router's journal."""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from dataclasses import dataclass, field

import ray
from outrider.cluster.actors import DraftReplica, RouterReplica, TargetDriver, TargetRank
from outrider.cluster.spec import ClusterSpec, ModelPair
from outrider.target_worker.main import runner_config
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

NAME = "outrider-controller"
NAMESPACE = "outrider"
REGISTRY_TTL_S = 10.0
START_TIMEOUT_S = 600.0


@dataclass
class Draft:
    actor: object
    port: int = 0
    node_id: str | None = None
    address: str = ""
    busy_s: float = 0.0          # drafting seconds at the last autoscale look


@dataclass
class Target:
    index: int                   # among all the cluster's targets
    pair: ModelPair              # the model pair it serves (its drafts are the pair's)
    pg: object = None
    driver: object = None
    ranks: list = field(default_factory=list)
    drafts: list[Draft] = field(default_factory=list)
    address: str = ""
    restarts: int = 0


class Controller:
    def __init__(self, spec: dict, token: str, started_ray: bool = False) -> None:
        self.spec = ClusterSpec.model_validate(spec)
        self.token, self.started_ray = token, started_ray
        self.targets: list[Target] = []
        self.router = None
        self.router_address = ""
        self.events: list[str] = []     # what the controller did, newest last
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- bring up ------------------------------------------------------------------------
    def up(self) -> dict:
        with self._lock:
            if not self.targets:
                pairs = [p for p in self.spec.models for _ in range(p.target_replicas)]
                self.targets = [Target(i, pair) for i, pair in enumerate(pairs)]
                for target in self.targets:
                    target.drafts = [self._start_draft(Draft(None), target.pair)
                                     for _ in range(target.pair.drafts_per_target)]
                    self._start_target(target)
                if self.spec.router.enabled:
                    self._start_router()
                self._watcher = threading.Thread(target=self._watch, daemon=True)
                self._watcher.start()
        return self.endpoints()

    def endpoints(self) -> dict:
        r = self.spec.router
        if not r.enabled:
            return {"router": None, "http": None, "targets": [t.address for t in self.targets]}
        host = r.host if r.host != "0.0.0.0" else self.router_address.rsplit(":", 1)[0]
        return {"router": self.router_address,
                "http": f"{host}:{r.http_port}" if r.http_port is not None else None,
                "targets": [t.address for t in self.targets]}

    def _start_draft(self, draft: Draft, pair: ModelPair) -> Draft:
        options = {**pair.draft_resources.ray_options(), "max_concurrency": 4}
        if draft.node_id:  # a restart: back where its target expects it, if there is room
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(draft.node_id,
                                                                            soft=True)
        draft.actor = ray.remote(DraftReplica).options(**options).remote(
            self._runner(pair, pair.draft), self.spec.worker_host, draft.port, self.token,
            pair.draft_metrics_port, pair.adapt, self.spec.redis_url,
            f"{self.spec.name}-{pair.name}",  # adapting drafts share versions in Redis
            pair.target,  # a head's embedding; a draft of another vocabulary's tokenizer
            pair.speculation_cache, pair.cache_aware_sampling)
        draft.address = ray.get(draft.actor.address.remote(), timeout=START_TIMEOUT_S)
        draft.port = int(draft.address.rsplit(":", 1)[1])
        draft.node_id = ray.get(draft.actor.where.remote())["node_id"]
        return draft

    def _start_target(self, target: Target) -> None:
        pair = target.pair
        bundles = [pair.target_resources.bundle() for _ in range(pair.tp)]
        target.pg = placement_group(bundles, strategy="STRICT_PACK",
                                    name=f"{self.spec.name}-target-{target.index}")
        ray.get(target.pg.ready(), timeout=START_TIMEOUT_S)

        def in_bundle(k: int) -> dict:
            return {"num_cpus": pair.target_resources.cpus,
                    "num_gpus": pair.target_resources.gpus, "max_concurrency": 4,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        target.pg, placement_group_bundle_index=k)}
        cfg = self._target_config(pair, self._runner(pair, pair.target, tp=pair.tp,
                                                     quantization=pair.quantization),
                                  [d.address for d in target.drafts])
        runner = runner_config(cfg)  # (every rank's: they agree on the KV blocks)
        target.driver = ray.remote(TargetDriver).options(**in_bundle(0)).remote()
        init_method = ray.get(target.driver.init_method.remote())
        target.ranks = [ray.remote(TargetRank).options(**in_bundle(k)).remote(
            runner, k, init_method) for k in range(1, pair.tp)]
        target.address = ray.get(target.driver.start.remote(cfg, self.token, init_method),
                                 timeout=START_TIMEOUT_S)
        self._register(target.address)

    def _start_router(self) -> None:
        from outrider.router.main import RouterConfig
        from outrider.router.service import ServiceLimits

        r, first = self.spec.router, self.spec.pair
        cfg = RouterConfig(first.target, (), r.host, r.grpc_port, self.spec.redis_url,
                           http_port=r.http_port, metrics_port=r.metrics_port,
                           served_model_name=first.name,
                           also_serve=tuple(f"{p.name}={p.target}" for p in self.spec.models[1:]),
                           limits=ServiceLimits(replica_wait_s=r.replica_wait_s,
                                                max_running=r.max_running_requests),
                           routing=r.routing)
        self.router = ray.remote(RouterReplica).options(
            **r.resources.ray_options(), max_concurrency=4).remote(cfg, self.token)
        self.router_address = ray.get(self.router.address.remote(), timeout=START_TIMEOUT_S)
        # the targets again: their registrations (REGISTRY_TTL_S) can expire while a router
        # starts (on a busy machine it took longer), and a router finds replicas only there
        for target in self.targets:
            self._register(target.address)

    def _runner(self, pair: ModelPair, model_dir: str, tp: int = 1,
                quantization: str | None = None):
        from outrider.engine.runner import RunnerConfig

        return RunnerConfig(model_dir=model_dir, device=pair.device, dtype=pair.dtype, tp=tp,
                            kv_cache_mb=pair.kv_cache_mb,
                            memory_utilization=pair.gpu_memory_utilization,
                            max_num_seqs=pair.max_num_seqs, threads=pair.threads,
                            prefix_caching=pair.prefix_caching, compile=pair.compile,
                            enforce_eager=pair.enforce_eager,
                            prepared_rows=pair.max_batch_tokens, quantization=quantization)

    def _target_config(self, pair: ModelPair, runner, draft_addresses: list[str]):
        from outrider.target_worker.main import TargetWorkerConfig
        from outrider.target_worker.scheduler import SchedulerConfig

        policy = self.spec.policy
        return TargetWorkerConfig(
            runner, SchedulerConfig(max_num_seqs=pair.max_num_seqs,
                                    max_batch_tokens=pair.max_batch_tokens),
            tuple(draft_addresses), pair.gamma, self.spec.worker_host, 0,
            overlap_max_seqs=policy.overlap_max_seqs, hot_heat=policy.hot_heat,
            cool_heat=policy.cool_heat, metrics_port=pair.target_metrics_port,
            auto_gamma_max=pair.auto_gamma_max, proposer=pair.proposer,
            draft_head=pair.draft if pair.draft_is_head else None,  # (its features to send)
            self_draft_layers=pair.self_draft_layers, ngram_sizes=pair.ngram_sizes)

    def _register(self, address: str) -> None:
        """Into the shared registry: routers find the replica there and keep it alive."""
        from outrider.state import RedisStore
        from outrider.v1 import state_pb2 as st

        RedisStore(self.spec.redis_url).put_replica(
            st.ReplicaRecord(address=address, heartbeat_unix_s=time.time()), REGISTRY_TTL_S)

    # -- supervision ---------------------------------------------------------------------
    def _watch(self) -> None:
        last_scale = time.monotonic()
        while not self._stop.wait(self.spec.health_period_s):
            try:
                self._heal()
                # every pair's drafts at the shortest period any pair asks for
                period = min((p.autoscale.period_s for p in self.spec.models
                              if p.autoscale.enabled), default=None)
                if period is not None and time.monotonic() - last_scale >= period:
                    self._autoscale(time.monotonic() - last_scale)
                    last_scale = time.monotonic()
            except Exception:  # the watcher must outlive any one failure
                self._log("watch failed: " + traceback.format_exc(limit=3))

    def _heal(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            for target in self.targets:
                for k, draft in enumerate(target.drafts):
                    if not _alive(draft.actor):
                        self._log(f"draft {k} of target {target.index} died: restarting")
                        self._start_draft(draft, target.pair)
                if not all(_alive(a) for a in [target.driver, *target.ranks]):
                    self._log(f"target {target.index} lost a rank: restarting the replica")
                    self._stop_target(target, grace_s=0)
                    target.restarts += 1
                    self._start_target(target)
            if self.router is not None and not _alive(self.router):
                self._log("router died: restarting")
                self._start_router()

    def _autoscale(self, period_s: float) -> None:
        with self._lock:
            for target in self.targets:
                autoscale = target.pair.autoscale
                if not autoscale.enabled or not target.drafts:
                    continue
                busy = [ray.get(d.actor.busy_seconds.remote()) for d in target.drafts]
                fraction = sum(b - d.busy_s for b, d in zip(busy, target.drafts)) / (
                    period_s * len(busy))
                for b, d in zip(busy, target.drafts):
                    d.busy_s = b
                n = len(target.drafts)
                if fraction > autoscale.scale_up_busy and n < autoscale.max_drafts:
                    self.scale_drafts(target.index, n + 1)
                elif fraction < autoscale.scale_down_busy and n > autoscale.min_drafts:
                    self.scale_drafts(target.index, n - 1)

    def scale_drafts(self, target_index: int, count: int) -> list[str]:
        """Run `count` draft replicas for this target, while its requests go on."""
        if count < 1:
            raise ValueError("a target with a draft model keeps at least one draft replica")
        with self._lock:
            target = self.targets[target_index]
            while len(target.drafts) < count:
                target.drafts.append(self._start_draft(Draft(None), target.pair))
                self._set_drafts(target)
                self._log(f"target {target_index}: draft replica added ({count})")
            while len(target.drafts) > count:
                gone = target.drafts.pop()
                self._set_drafts(target)  # first the target lets go, then the replica stops
                time.sleep(0.5)
                _stop_actor(gone.actor, grace_s=2.0)
                self._log(f"target {target_index}: draft replica removed ({count})")
            return [d.address for d in target.drafts]

    def _set_drafts(self, target: Target) -> None:
        from outrider.cluster_tls import internal_channel
        from outrider.grpc_server import token_metadata
        from outrider.v1 import worker_pb2 as pb
        from outrider.v1 import worker_pb2_grpc

        with internal_channel(target.address) as channel:
            worker_pb2_grpc.TargetStub(channel).SetDraftReplicas(
                pb.DraftReplicas(addresses=[d.address for d in target.drafts]),
                metadata=token_metadata(self.token), timeout=30)

    # -- reports -------------------------------------------------------------------------
    def status(self) -> dict:
        rows = []
        with self._lock:
            targets = list(self.targets)
            router = self.router
        for target in targets:
            load = _call(target.driver.load) or {}
            rows.append(_row("target", target.index, target.address, target.driver, load,
                             restarts=target.restarts, tp=len(target.ranks) + 1,
                             model=target.pair.name))
            for k, rank in enumerate(target.ranks, start=1):
                rows.append(_row(f"target rank {k}", target.index, target.address, rank, {}))
            for k, draft in enumerate(target.drafts):
                rows.append(_row(f"draft {k}", target.index, draft.address, draft.actor, {}))
        if router is not None:
            rows.append(_row("router", "-", self.router_address, router, {}))
        return {"rows": rows, "endpoints": self.endpoints(), "events": self.events[-20:],
                "started_ray": self.started_ray}

    def _log(self, message: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {message}")

    # -- shutdown ------------------------------------------------------------------------
    def down(self, grace_s: float = 10.0) -> None:
        """Drain: the router stops taking requests and finishes those in flight, then the
        targets, then the drafts; placement groups are removed."""
        self._stop.set()
        with self._lock:
            if self.router is not None:
                _stop_actor(self.router, grace_s)
                self.router = None
            for target in self.targets:
                self._stop_target(target, grace_s)
                for draft in target.drafts:
                    _stop_actor(draft.actor, grace_s)
            self.targets = []

    def _stop_target(self, target: Target, grace_s: float) -> None:
        if target.driver is not None:
            _stop_actor(target.driver, grace_s)
        for rank in target.ranks:
            ray.kill(rank)
        if target.pg is not None:
            remove_placement_group(target.pg)
        target.driver, target.ranks, target.pg = None, [], None


def _alive(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=30)
        return True
    except Exception:
        return False


def _call(method):
    try:
        return ray.get(method.remote(), timeout=10)
    except Exception:
        return None


def _stop_actor(actor, grace_s: float) -> None:
    with contextlib.suppress(Exception):  # already gone, or stuck: killed below either way
        ray.get(actor.stop.remote(grace_s), timeout=grace_s + 30)
    ray.kill(actor)


def _row(role: str, target, address: str, actor, load: dict, **extra) -> dict:
    place = _call(actor.where) or {"node_ip": "?", "device": "?", "pid": 0, "rss_mb": 0.0,
                                   "node_id": "?"}
    return {"role": role, "target": target, "address": address, **place,
            "alive": bool(_call(actor.ping)), "heat": load.get("heat"),
            "tokens_per_s": load.get("tokens_per_s"), "running": load.get("num_running"),
            "waiting": load.get("num_waiting"), **extra}
