"""`outrider serve`: router, target worker and draft worker(s) as processes on this
machine (no Ray), wired together, stopped together."""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from dataclasses import dataclass

from outrider.launch import process_group


@dataclass(frozen=True)
class LocalSystemConfig:
    target: str
    draft: str | None
    draft_replicas: int = 1
    tp: int = 1
    gamma: int = 4
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    redis_url: str | None = None
    device: str = "cpu"
    kv_cache_mb: float = 256.0
    max_batch_tokens: int = 512
    max_num_seqs: int = 64
    extra_target_args: tuple[str, ...] = ()
    extra_router_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.draft and self.draft_replicas < 1:
            raise ValueError("--draft-replicas must be >= 1 with a draft model")


@dataclass(frozen=True)
class LocalSystem:
    router: str                 # host:port of the public API
    target: str                 # host:port of the target replica (cluster token required)
    drafts: tuple[str, ...]


@contextmanager
def local_system(cfg: LocalSystemConfig, token: str | None = None, echo: bool = False):
    """Start everything; yields the LocalSystem's addresses. Workers listen on free
    loopback ports and require `token` (a fresh random one by default)."""
    with process_group(token or secrets.token_urlsafe(24)) as start:
        def run(name: str, *args: str) -> str:
            return start(*args, echo=f"[{name}] " if echo else None)[1]

        drafts = tuple(run(f"draft-{i}", "draft-worker", "--model", cfg.draft,
                           "--device", cfg.device)
                       for i in range(cfg.draft_replicas if cfg.draft else 0))
        target = run("target", "target-worker", "--model", cfg.target, "--tp", str(cfg.tp),
                     "--gamma", str(cfg.gamma), "--device", cfg.device,
                     "--kv-cache-mb", str(cfg.kv_cache_mb),
                     "--max-batch-tokens", str(cfg.max_batch_tokens),
                     "--max-num-seqs", str(cfg.max_num_seqs),
                     *[a for d in drafts for a in ("--draft-address", d)],
                     *cfg.extra_target_args)
        router = run("router", "router", "--model", cfg.target, "--target-address", target,
                     "--host", cfg.host, "--port", str(cfg.grpc_port),
                     *(["--redis", cfg.redis_url] if cfg.redis_url else []),
                     *cfg.extra_router_args)
        yield LocalSystem(router, target, drafts)
