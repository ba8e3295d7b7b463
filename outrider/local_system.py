"""`outrider serve`: router, target worker and draft worker(s) as processes on this
machine (no Ray), wired together, kept running (a process that dies is restarted),
stopped together. A draft head (EAGLE-3, EAGLE-1) runs in the target worker's process:
it reads the target's hidden states, so it starts no draft worker; with
`head_on_replicas` it runs on draft workers, the features sent with each Propose."""

from __future__ import annotations

import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from outrider.core.hf_config import checkpoint_name, head_kind
from outrider.core.sequence import NGRAM_SIZES
from outrider.core.tokenizer import shares_vocabulary
from outrider.cpus import plan_cpus
from outrider.flags import check_self_draft, resolve_device, served_as
from outrider.launch import RestartPolicy, free_port, supervised_group
from outrider.target_worker.main import TargetWorkerConfig
from outrider.target_worker.scheduler import SchedulerConfig


@dataclass(frozen=True)
class LocalSystemConfig:
    target: str
    draft: str | None
    draft_replicas: int = 1
    tp: int = 1
    gamma: int = TargetWorkerConfig.gamma
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    redis_url: str | None = None
    device: str = "cpu"
    kv_cache_mb: float | None = 256.0  # per target rank; None: sized from memory
    max_batch_tokens: int = SchedulerConfig.max_batch_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    extra_target_args: tuple[str, ...] = ()
    extra_draft_args: tuple[str, ...] = ()
    extra_router_args: tuple[str, ...] = ()
    http_port: int | None = None    # the router's OpenAI-compatible API (0: a free port)
    metrics: bool = False           # every process serves /metrics on a free port
    pin_cpus: bool = True           # on a CPU: cores per role (outrider.cpus)
    target_replicas: int = 1        # behind the one router; they share the draft replicas
    prefix_caching: bool = True     # in every replica's KV cache
    adapt: bool = False             # online distillation on the draft replicas
    speculation_cache: bool = False  # the draft replicas' (draft_worker/spec_cache.py)
    cache_aware_sampling: float | None = None  # their sampled rows too (draft-worker's flag)
    dtype: str = "auto"             # of both models
    quantization: str | None = None  # the targets' --quantization (vLLM's: fp8 on load)
    compile: bool = False           # compiled forwards in every replica (--compile)
    enforce_eager: bool = False     # GPU: no CUDA graphs in any replica (--enforce-eager)
    proposer: str = TargetWorkerConfig.proposer.value  # the targets' --proposer
    restarts: RestartPolicy = RestartPolicy()  # of a process that dies (outrider.launch)
    max_model_len: int | None = None  # the target's and router's (None: the model's)
    tree_topk: int = 1                # token trees (with a head: engine/tree.py)
    tree_tokens: int = 0
    head_on_replicas: bool = False    # a head drafts on draft replicas, not in the target
    self_draft_layers: str | None = None  # the targets' own layers draft (layer_skip.py)
    ngram_sizes: tuple[int, int] = NGRAM_SIZES  # the targets' --ngram-sizes
    memory_utilization: float | None = None  # --gpu-memory-utilization: all replicas'
    #                                          share of the GPU, split (gpu_shares)
    # other targets served beside `target` by the one router, a replica each, speculating
    # with the same draft replicas (of any tokenizer: they draft through text); DIR or
    # NAME=DIR (outrider.flags.served_as)
    also_serve: tuple[str, ...] = ()
    # other draft models for `target`: each on draft_replicas replicas of its own, with
    # target_replicas target replicas speculating with it; the router sends each request
    # to the replica, so the draft, it expects to serve it soonest (router/replicas.py)
    also_draft: tuple[str, ...] = ()

    @property
    def targets(self) -> list[str]:
        return [self.target, *(served_as(entry)[1] for entry in self.also_serve)]

    @property
    def target_plan(self) -> list[tuple[str, int]]:
        """Each target replica: its checkpoint and the draft model it speculates with
        (its index in `drafts`; 0 with none): the first target, target_replicas replicas
        with each draft model; every other target (--also-serve), one with the first's."""
        return ([(self.target, k) for k in range(max(1, len(self.drafts)))
                 for _ in range(self.target_replicas)]
                + [(t, 0) for t in self.targets[1:]])

    @property
    def num_target_replicas(self) -> int:
        return len(self.target_plan)

    def __post_init__(self) -> None:
        if self.draft and self.draft_replicas < 1:
            raise ValueError("--draft-replicas must be >= 1 with a draft model")
        if self.target_replicas < 1:
            raise ValueError("--target-replicas must be >= 1")
        kind = head_kind(self.draft) if self.draft else None
        if self.head_on_replicas and kind not in ("eagle3", "eagle1"):
            raise ValueError("--head-on-replicas needs an EAGLE-3 or EAGLE-1 head as --draft "
                             "(Medusa heads draft in the target's process)")
        if self.cache_aware_sampling is not None and not self.speculation_cache:
            raise ValueError("--cache-aware-sampling needs --speculation-cache")
        check_self_draft(self.self_draft_layers, "--draft", self.draft)
        if self.also_draft and (not self.draft or kind
                                or any(head_kind(d) for d in self.also_draft)):
            raise ValueError("--also-draft: another draft model beside --draft's (a draft "
                             "model, not a head: heads draft in their target's process)")
        if self.also_serve or self.also_draft:
            self._check_targets(kind)
        if self.tree_topk > 1 and (self.head_on_replicas
                                   or not (kind or self.self_draft_layers)):
            raise ValueError("--tree-topk > 1 needs a draft head (--draft DIR of an EAGLE "
                             "or Medusa head) in the target's process, or "
                             "--self-draft-layers: draft replicas propose chains")

    def _check_targets(self, head_kind: str | None) -> None:
        """Several targets (--also-serve): told apart by their dirs' names, sharing the
        draft replicas, which draft for another vocabulary through text only."""
        for what, dirs in (("targets", self.targets), ("draft models", self.drafts)):
            names = [checkpoint_name(d) for d in dirs]
            if len(set(names)) != len(names):
                raise ValueError(f"the {what}' dirs must have distinct names (replicas are "
                                 f"told apart by them: model pairs, statistics), got {names}")
        if head_kind or self.self_draft_layers:
            raise ValueError("--also-serve shares draft replicas among targets: a draft "
                             "model, or none; a head or --self-draft-layers belongs to one "
                             "target")
        for draft in self.drafts if self.speculation_cache or self.adapt else ():
            other = next((t for t in self.targets if not shares_vocabulary(t, draft)), None)
            if other:
                raise ValueError(f"{other} has another vocabulary than the draft {draft}, "
                                 "which drafts for it through text: without "
                                 "--speculation-cache or --adapt (both work in the draft's ids)")

    @property
    def drafts(self) -> list[str]:
        """The draft models, each on replicas of its own."""
        return [self.draft, *self.also_draft] if self.draft else []


@dataclass(frozen=True)
class LocalSystem:
    router: str                 # host:port of the public API
    targets: tuple[str, ...]    # host:port of the target replicas (cluster token required)
    drafts: tuple[str, ...]
    http: str | None = None     # host:port of the OpenAI-compatible API
    metrics: dict[str, str] = field(default_factory=dict)  # process name -> host:port

    @property
    def target(self) -> str:
        """The first target replica."""
        return self.targets[0]


@contextmanager
def local_system(cfg: LocalSystemConfig, token: str | None = None, echo: bool = False,
                 env: dict[str, str] | None = None, stopping: threading.Event | None = None):
    """Start everything (with `env` added to the environment); yields the LocalSystem's
    addresses. Workers listen on free loopback ports and require `token` (a fresh random
    one by default). A process that dies is restarted on its port (`cfg.restarts`); one
    that keeps dying sets `stopping` (`outrider serve` waits on it), and leaving raises
    RoleFailed naming it."""
    on_give_up = stopping.set if stopping is not None else lambda: None
    with supervised_group(token or secrets.token_urlsafe(24), env, cfg.restarts,
                          on_give_up) as start:
        metrics: dict[str, str] = {}
        # the plan gives one target replica cores of its own; several would share them
        is_pinned = cfg.pin_cpus and cfg.device == "cpu" and cfg.num_target_replicas == 1
        cpus = plan_cpus() if is_pinned else None
        pinned = lambda role: ("--cpus", getattr(cpus, role)) if cpus else ()  # noqa: E731

        def run(name: str, *args: str) -> str:
            if cfg.metrics:  # the router's on its --host, the workers' on their default
                host = cfg.host if name == "router" else TargetWorkerConfig.host
                metrics[name] = f"{host}:{free_port()}"
                args = (*args, "--metrics-port", metrics[name].rsplit(":", 1)[1])
            return start(name, *args, echo=f"[{name}] " if echo else None)

        caching = () if cfg.prefix_caching else ("--no-enable-prefix-caching",)
        context = ("--max-model-len", str(cfg.max_model_len)) if cfg.max_model_len else ()
        model = ("--device", cfg.device, "--dtype", cfg.dtype, *caching,
                 "--compile" if cfg.compile else "--no-compile",
                 *(("--enforce-eager",) if cfg.enforce_eager else ()))
        head = cfg.draft if cfg.draft and head_kind(cfg.draft) else None
        num_drafts = cfg.draft_replicas if cfg.draft and (cfg.head_on_replicas or not head) \
            else 0
        draft_share, target_share = gpu_shares(cfg, num_drafts * len(cfg.drafts))
        # each draft model's replicas (the first's named draft-0, draft-1, ... as before)
        groups = [tuple(run(f"draft-{k * num_drafts + i}", "draft-worker", "--model", draft,
                            *model,
                            # (a head's; each target's vocabulary, its own or through text)
                            *[a for t in cfg.targets for a in ("--target-model", t)],
                            *draft_share,
                            *(("--adapt",) if cfg.adapt else ()),
                            *(("--speculation-cache",) if cfg.speculation_cache else ()),
                            *(("--cache-aware-sampling", str(cfg.cache_aware_sampling))
                              if cfg.cache_aware_sampling is not None else ()),
                            *(("--adapt-redis", cfg.redis_url) if cfg.adapt and cfg.redis_url
                              else ()),
                            *(("--target-cpus", cpus.target, "--threads", "1") if cpus
                              else ()),
                            *cfg.extra_draft_args)
                        for i in range(num_drafts))
                  for k, draft in enumerate(cfg.drafts)] or [()]
        drafts = tuple(a for group in groups for a in group)
        replicas = [(model_dir, groups[k]) for model_dir, k in cfg.target_plan]
        targets = tuple(run("target" if i == 0 else f"target-{i}", "target-worker",
                            "--model", model_dir, "--tp", str(cfg.tp),
                            "--gamma", str(cfg.gamma), "--proposer", cfg.proposer, *model,
                            "--ngram-sizes", ",".join(map(str, cfg.ngram_sizes)),
                            *(("--quantization", cfg.quantization) if cfg.quantization
                              else ()),
                            *target_share,
                            *(("--kv-cache-mb", str(cfg.kv_cache_mb)) if cfg.kv_cache_mb
                              else ()), *context,
                            "--max-batch-tokens", str(cfg.max_batch_tokens),
                            "--max-num-seqs", str(cfg.max_num_seqs),
                            *[a for d in group for a in ("--draft-address", d)],
                            *(("--draft-head", head) if head else ()),
                            *(("--self-draft-layers", cfg.self_draft_layers)
                              if cfg.self_draft_layers else ()),
                            "--tree-topk", str(cfg.tree_topk),
                            "--tree-tokens", str(cfg.tree_tokens),
                            *(("--small-step-threads", str(cpus.small_step_threads))
                              if cpus else ()), *cfg.extra_target_args)
                        for i, (model_dir, group) in enumerate(replicas))
        http_port = None if cfg.http_port is None else cfg.http_port or free_port()
        router = run("router", "router", "--model", cfg.target,
                     *[a for t in cfg.also_serve for a in ("--also-serve", t)],
                     *[a for t in targets for a in ("--target-address", t)],
                     "--host", cfg.host, "--port", str(cfg.grpc_port),
                     *(["--redis", cfg.redis_url] if cfg.redis_url else []),
                     *(["--no-http"] if http_port is None else ["--http-port", str(http_port)]),
                     *pinned("router"), *context, *cfg.extra_router_args)
        http = None if http_port is None else f"{cfg.host}:{http_port}"
        yield LocalSystem(router, targets, drafts, http, metrics)


DRAFT_GPU_SHARE = 0.1  # of the processes' share of one GPU, for all draft replicas


def gpu_shares(cfg: LocalSystemConfig, num_drafts: int) -> tuple[tuple[str, ...], ...]:
    """The --gpu-memory-utilization flags of (each draft replica, each target replica).
    On a GPU every process takes its own share of the device (engine/memory.py), and here
    they all run on the one machine's GPU: the whole share (default 0.9, as vLLM's) is
    split, DRAFT_GPU_SHARE of it to the draft replicas, the rest to the targets. On a
    CPU the flag is each rank's share of RAM: passed on as given."""
    if resolve_device(cfg.device) == "cpu":
        given = (("--gpu-memory-utilization", str(cfg.memory_utilization))
                 if cfg.memory_utilization else ())
        return given, given
    from outrider.engine.memory import GPU_SHARE  # (torch's import, where a GPU serves)

    whole = cfg.memory_utilization or GPU_SHARE
    drafts = whole * DRAFT_GPU_SHARE if num_drafts else 0.0
    flag = lambda share: ("--gpu-memory-utilization", f"{share:.4f}")  # noqa: E731
    draft_flag = flag(drafts / num_drafts) if num_drafts else ()
    return draft_flag, flag((whole - drafts) / cfg.num_target_replicas)
