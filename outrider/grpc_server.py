"""What every Outrider gRPC server has: the cluster-token check, the standard health
service, server reflection, and a clean stop."""

from __future__ import annotations

import hmac
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

TOKEN_METADATA_KEY = "x-outrider-cluster-token"
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ClusterTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls that do not carry the cluster's shared token (health and
    reflection stay open so probes work)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_METHODS):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(sent.encode(), self._token):
            return continuation(handler_call_details)
        return _refuse(f"missing or wrong {TOKEN_METADATA_KEY}")


class StrictParsing(grpc.ServerInterceptor):
    """A request that does not parse (malformed protobuf, invalid UTF-8 in a string)
    gets INVALID_ARGUMENT naming the message, not gRPC's INTERNAL "Exception
    deserializing request!", which reads as a server fault."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        for kind in ("unary_unary", "unary_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(request_deserializer=None,
                                        **{kind: _parsing(parse, behavior)})
        return handler


def _parsing(parse, behavior):
    def call(raw: bytes, context):
        try:
            request = parse(raw)
        except Exception as exc:  # DecodeError, or anything a parser raises
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request: not a valid message ({exc})")
        return behavior(request, context)
    return call


def _refuse(message: str):
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.unary_unary_rpc_method_handler(deny)


@dataclass
class Running:
    """A started server and what to close once it has drained."""

    server: grpc.Server
    address: str
    closers: list[Callable[[], None]] = field(default_factory=list)
    service: object = None  # the servicer, for whoever hosts it in-process (Ray actors)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking calls, let those in flight drain for `grace_s`, then close."""
        self.server.stop(grace=grace_s).wait()
        for close in self.closers:
            close()


def serve_until_signalled(running: Running, name: str, grace_s: float = 5.0) -> None:
    """Say where it listens (launchers read this line) and run until SIGTERM/SIGINT."""
    print(f"{name} listening on {running.address}", flush=True)
    stopping = threading.Event()
    if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopping.set())
    wait_until_set(stopping)
    running.stop(grace_s)


def wait_until_set(event: threading.Event) -> None:
    """Block until `event` is set (by a signal handler), in timed waits: a signal the
    kernel hands to another thread only flags the handler, which the main thread runs when
    it next runs Python code; blocked in an untimed wait it never does (a SIGTERMed worker
    kept serving, 1 run in 30 on a busy machine)."""
    while not event.wait(timeout=1.0):
        pass


def remaining_timeout(context) -> float | None:
    """The caller's deadline, to pass on to calls made for it (None: it set none; gRPC
    then reports a time remaining of ~2^63 seconds, which must not be passed on)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e9 else remaining


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, token),) if token else ()


def build_server(add_servicers, service_names: list[str], address: str,
                 token: str | None, max_workers: int = 16,
                 credentials: grpc.ServerCredentials | None = None,
                 health_servicer: health.HealthServicer | None = None,
                 max_message_mb: int = 64) -> tuple[grpc.Server, int]:
    """Start-ready server with health + reflection, on TLS when `credentials` are given;
    returns (server, bound port). Every service starts SERVING in `health_servicer`
    (given when the caller changes statuses later)."""
    interceptors = [*([ClusterTokenInterceptor(token)] if token else []), StrictParsing()]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=interceptors,
                         options=[("grpc.max_receive_message_length", max_message_mb * 2**20),
                                  ("grpc.max_send_message_length", max_message_mb * 2**20)])
    add_servicers(server)
    health_servicer = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in [*service_names, ""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = (server.add_secure_port(address, credentials) if credentials
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port
