"""API keys (stored as SHA-256 digests, never in clear) and per-key rate limits.

Keys arrive as `authorization: Bearer <key>` metadata. A verified key is remembered for
a little while, so a router keeps authenticating while the shared store is away."""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass

import grpc

from outrider.state import StoreUnavailable
from outrider.v1 import state_pb2 as st

KEY_PREFIX = "or-"


@dataclass
class AuthError(Exception):
    code: grpc.StatusCode
    message: str
    retry_after_s: float = 0.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer_token(metadata) -> str | None:
    for k, v in metadata or ():
        if k == "authorization":
            scheme, _, token = v.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class Authenticator:
    def __init__(self, store, is_required: bool, cache_s: float = 30.0) -> None:
        self.store = store
        self.is_required = is_required
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, st.ApiKeyRecord]] = {}
        self._own: dict[str, st.ApiKeyRecord] = {}  # this router's configured keys
        self._lock = threading.Lock()

    def add_key(self, key: str, record: st.ApiKeyRecord) -> None:
        """A key this router was configured with: kept here too (by digest), so it
        works through a store that restarted empty; also shared through the store."""
        digest = hash_key(key)
        self._own[digest] = record
        with contextlib.suppress(StoreUnavailable):  # it works on this router meanwhile
            self.store.put_api_key(digest, record)

    def check(self, metadata, tag: str) -> st.ApiKeyRecord | None:
        """The caller's key record (None when keys are not required); raises AuthError."""
        if not self.is_required:
            return None
        key = bearer_token(metadata)
        if not key:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "missing API key: send 'authorization: Bearer <key>'")
        digest = hash_key(key)
        record = self._record(digest)
        if record is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        if record.disabled:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            f"API key {record.name!r} is disabled")
        if record.tags and tag not in record.tags:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            f"API key {record.name!r} may not use tag {tag!r}")
        self._take_request(digest, record)
        return record

    def _record(self, digest: str) -> st.ApiKeyRecord | None:
        if digest in self._own:
            return self._own[digest]
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(digest)
        if cached and now - cached[0] < self.cache_s:
            return cached[1]
        try:
            record = self.store.api_key(digest)
        except StoreUnavailable:
            if cached:  # keep serving a key we know while the store is away
                return cached[1]
            raise AuthError(grpc.StatusCode.UNAVAILABLE,
                            "cannot verify the API key right now", retry_after_s=1.0) from None
        if record is not None:  # unknown keys are asked again: a new key works at once
            with self._lock:
                self._cache[digest] = (now, record)
        return record

    def _take_request(self, digest: str, record: st.ApiKeyRecord) -> None:
        try:
            wait_s = self.store.take_request(digest, record)
        except StoreUnavailable:
            return  # limits are shared state: without the store, serve rather than refuse
        if wait_s > 0:
            raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"rate limit of {record.requests_per_minute} requests/minute for "
                            f"API key {record.name!r} reached; retry after {wait_s:.2f}s",
                            retry_after_s=wait_s)
