"""`outrider keys`: API keys in the shared store (Redis)."""

from __future__ import annotations

import argparse


def keys_flags(keys: argparse.ArgumentParser) -> None:
    keys.add_argument("action", choices=["create"], help="create: a new key, printed once")
    keys.add_argument("--redis", required=True, help="redis://host:port/db")
    keys.add_argument("--name", required=True, help="who the key is for (in logs and metrics)")
    keys.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    keys.add_argument("--burst", type=int, default=10,
                      help="requests allowed at once above the per-minute rate")
    keys.add_argument("--tag", action="append", default=[], help="allowed tag (repeatable)")


def cmd_keys(args) -> int:
    """Prints the new key once: the store keeps only its hash."""
    from outrider.router.auth import hash_key, new_key
    from outrider.state import RedisStore
    from outrider.v1 import state_pb2 as st

    key = new_key()
    RedisStore(args.redis).put_api_key(hash_key(key), st.ApiKeyRecord(
        name=args.name, requests_per_minute=args.rpm, burst=args.burst, tags=args.tag))
    print(key)
    return 0
