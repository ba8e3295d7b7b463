"""Channel settings shared by Client and AsyncClient: retries on UNAVAILABLE through the
gRPC service config, reconnect backoff, TLS (and mTLS) credentials, the API key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from outrider.telemetry.tracing import traced_metadata
from outrider.v1.generate_pb2 import DESCRIPTOR

SERVICE = DESCRIPTOR.services_by_name["Generation"].full_name
API_KEY_ENV = "OUTRIDER_API_KEY"


@dataclass(frozen=True)
class Retry:
    """gRPC's own retries of calls that failed with UNAVAILABLE before any message came
    back (a router restarting, no replica yet). gRPC waits a random time up to the
    current backoff between attempts, or the router's pushback when it sends one."""

    max_attempts: int = 5             # gRPC caps this at 5
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts must be in [1, 5], got {self.max_attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s or self.multiplier <= 0:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s and multiplier > 0")

    def service_config(self) -> str:
        policy = {"maxAttempts": self.max_attempts,
                  "initialBackoff": f"{self.initial_backoff_s}s",
                  "maxBackoff": f"{self.max_backoff_s}s",
                  "backoffMultiplier": self.multiplier,
                  "retryableStatusCodes": ["UNAVAILABLE"]}
        return json.dumps({"methodConfig": [{"name": [{"service": SERVICE}],
                                             "retryPolicy": policy}]})



@dataclass(frozen=True)
class Tls:
    """Server verification with `ca` (PEM); a client certificate too for mTLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ValueError("mTLS needs both a client certificate and its key")
        read = lambda path: Path(path).read_bytes() if path else None
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


DEFAULT_RETRY = Retry()


@dataclass(frozen=True)
class CallSettings:
    """What every call of one client carries."""

    metadata: tuple[tuple[str, str], ...]
    timeout_s: float | None       # each call's deadline unless the call gives one
    wait_for_ready: bool | None   # None: wait exactly when the call has a deadline

    def for_call(self, timeout_s: float | None) -> dict:
        """A call with a deadline waits out a router that is restarting (up to the
        deadline); one without fails after the retries rather than hang forever."""
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        wait = self.wait_for_ready if self.wait_for_ready is not None else timeout is not None
        # the caller's current span (if any) becomes the parent of the router's
        return {"metadata": traced_metadata(self.metadata), "wait_for_ready": wait,
                "timeout": timeout}


def open_channel(grpc_module, address: str, tls: Tls | None, retry: Retry | None):
    """A channel from `grpc` or `grpc.aio` (same arguments, different classes)."""
    options = channel_options(retry)
    if tls:
        return grpc_module.secure_channel(address, tls.credentials(), options)
    return grpc_module.insecure_channel(address, options)


def channel_options(retry: Retry | None) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.enable_retries", 1 if retry else 0),
        # a restarted router is found within a second or two, not gRPC's default 1-120 s
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.max_receive_message_length", 64 * 2**20)]
    if retry:
        options.append(("grpc.service_config", retry.service_config()))
    return options


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Bearer metadata for `api_key`, else $OUTRIDER_API_KEY, else none."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {key}"),) if key else ()
