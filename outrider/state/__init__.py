"""The state routers and draft replicas share (docs/DESIGN.md §2.7): replica registry with
heartbeats, acceptance statistics per model pair and workload tag, API keys (hashed) with
rate limits applied atomically, a journal of each request's committed tokens, and the
draft versions of §8.6.

One interface, two homes: `RedisStore` when several processes share a Redis, and
`MemoryStore` in this process for a single router. Values are protobuf records
(protos/outrider/v1/state.proto) or integers: nothing read back is unpickled or
evaluated. A Redis that cannot be reached raises `StoreUnavailable`; callers decide
what to do without it (the router keeps serving). Torch-free: any role may import it.
"""

from __future__ import annotations

from outrider.state.contract import (
    MAX_ACCEPTANCE_ENTRIES,
    Resumable,
    StoreUnavailable,
    rate_limit_interval_ms,
)
from outrider.state.memory import MemoryStore
from outrider.state.redis_store import RedisStore

__all__ = ["MAX_ACCEPTANCE_ENTRIES", "MemoryStore", "RedisStore", "Resumable",
           "StoreUnavailable", "open_store", "rate_limit_interval_ms"]


def open_store(redis_url: str | None) -> MemoryStore | RedisStore:
    return RedisStore(redis_url) if redis_url else MemoryStore()
