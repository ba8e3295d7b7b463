"""`outrider router`: the public gRPC front door (API in protos/outrider/v1/generate.proto)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2
from outrider.router.admission import Admission
from outrider.router.auth import Authenticator
from outrider.router.chat_template import ChatTemplate
from outrider.router.http_api import GRACEFUL_STOP_S, HttpSettings, build_app, start_http
from outrider.router.http_guard import HttpBounds
from outrider.router.models import ModelIdentity, Models, ServedModel
from outrider.router.replicas import ROUTING, ReplicaSet
from outrider.router.service import GenerationService, ServiceLimits
from outrider.router.telemetry import RouterTelemetry
from outrider.router.tool_calls import CALL_FORMATS

from outrider.core.hf_config import context_length, read_config, sampling_defaults
from outrider.core.tokenizer import Tokenizer, tokenizer_file
from outrider.flags import (
    add_cpus_arg,
    add_max_model_len_arg,
    add_metrics_arg,
    served_as,
    served_model_id,
)
from outrider.grpc_server import Running, build_server, serve_until_signalled
from outrider.state import open_store
from outrider.telemetry.metrics import serve_metrics
from outrider.telemetry.tracing import setup_tracing
from outrider.v1 import generate_pb2_grpc
from outrider.v1 import state_pb2 as st
from outrider.v1.generate_pb2 import DESCRIPTOR

SERVICE_NAME = DESCRIPTOR.services_by_name["Generation"].full_name
API_KEYS_ENV = "OUTRIDER_API_KEYS"  # comma-separated keys this router accepts
# server threads beyond the running requests' (each holds one while it streams): health
# checks, Status and refusals stay answerable however many requests run
CONTROL_THREADS = 16


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str                          # tokenizer.json (and config.json) of the target
    target_addresses: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str | None = None
    require_api_key: bool = False           # also true when OUTRIDER_API_KEYS is set
    rate_limit_rpm: int = 0                 # per key from OUTRIDER_API_KEYS; 0: none
    rate_limit_burst: int = 10
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None        # mTLS: clients must present a cert it signed
    limits: ServiceLimits = ServiceLimits()
    heartbeat_s: float = 0.5
    http_port: int | None = 8000            # the OpenAI-compatible API; None: off
    metrics_port: int | None = None         # Prometheus (also at the HTTP API's /metrics)
    served_model_name: str | None = None    # its model id (default: the model dir's name)
    routing: str = "cache-aware"            # how a replica is chosen (router/replicas.py)
    max_prompts: int = HttpSettings.max_prompts  # prompts per HTTP completion request
    http_bounds: HttpBounds = HttpBounds()  # how long headers and bodies may take, how big
    strict_fields: bool = False             # HTTP bodies' unknown fields: 400, not ignored
    tool_call_parser: str | None = None     # tool_choice "auto": the model's call format
    generation_config: str = "auto"         # auto: unset sampling fields take the model's
    max_model_len: int | None = None        # requests longer are refused (None: the model's)
    chat_template: str | None = None        # a file or the template (None: the model's)
    # other targets served beside model_dir, each on its own replicas: DIR (named by
    # its dir) or NAME=DIR (outrider.flags.served_as)
    also_serve: tuple[str, ...] = ()

    @property
    def served(self) -> list[tuple[str, str]]:
        """(model id, checkpoint dir) of each model, the first first."""
        first = self.served_model_name or served_model_id(self.model_dir)
        return [(first, self.model_dir), *map(served_as, self.also_serve)]

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        for _, model_dir in self.served:  # (a TokenizerError, a ValueError, naming what lacks)
            tokenizer_file(model_dir)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        """From `outrider router`'s flags (add_arguments)."""
        return cls(args.model, tuple(args.target_address), args.host, args.port, args.redis,
                   args.require_api_key, args.rate_limit_rpm, tls_cert=args.tls_cert,
                   tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                   http_port=None if args.no_http else args.http_port,
                   metrics_port=args.metrics_port, served_model_name=args.served_model_name,
                   limits=ServiceLimits(max_running=args.max_running_requests,
                                        max_queued=args.max_queued_requests,
                                        max_queue_wait_s=args.max_queue_wait),
                   routing=args.routing, max_prompts=args.max_prompts_per_request,
                   http_bounds=HttpBounds(args.http_header_timeout, args.http_body_timeout,
                                          int(args.max_body_mb * 2**20)),
                   strict_fields=args.strict_openai_fields,
                   tool_call_parser=args.tool_call_parser,
                   generation_config=args.generation_config,
                   max_model_len=args.max_model_len, chat_template=args.chat_template,
                   also_serve=tuple(args.also_serve))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`outrider router`'s flags (RouterConfig.from_args reads them)."""
    p.add_argument("--model", required=True,
                   help="target checkpoint dir (its tokenizer.json and config.json)")
    p.add_argument("--target-address", action="append", default=[],
                   help="host:port of a target replica (repeatable; more are found in "
                        "the shared registry)")
    add_public_arguments(p)
    p.add_argument("--port", type=int, default=RouterConfig.port, help="0 picks a free port")
    add_max_model_len_arg(p)
    add_metrics_arg(p)
    add_cpus_arg(p)


def add_public_arguments(p: argparse.ArgumentParser,
                         http_port_flags: tuple[str, ...] = ("--http-port",),
                         host: str = RouterConfig.host) -> None:
    """The public side's flags: keys, rate limit, TLS, the HTTP API, admission (`outrider
    serve` takes them too, for its router, with vLLM's --port for the HTTP API's and its
    default host, every interface)."""
    p.add_argument("--host", default=host,
                   help="the interface the router's public ports listen on")
    p.add_argument("--redis", help="redis://host:port/db shared by routers (default: "
                                   "state in the router process)")
    p.add_argument("--require-api-key", action="store_true",
                   help="refuse calls without a key (implied by OUTRIDER_API_KEYS)")
    p.add_argument("--rate-limit-rpm", type=int, default=RouterConfig.rate_limit_rpm,
                   help="requests per minute per OUTRIDER_API_KEYS key (0: no limit)")
    p.add_argument("--tls-cert", help="PEM certificate for TLS on the public ports")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", help="mTLS: CA (PEM) whose client certificates the "
                                           "public ports require")
    p.add_argument(*http_port_flags, dest="http_port", type=int, default=RouterConfig.http_port,
                   help="port of the OpenAI-compatible HTTP API (0 picks a free port)")
    p.add_argument("--no-http", action="store_true", help="no HTTP API, gRPC only")
    p.add_argument("--served-model-name",
                   help="model id of the HTTP API (default: the target dir's name)")
    p.add_argument("--also-serve", action="append", default=[], metavar="[NAME=]DIR",
                   help="another target checkpoint served beside the first, on target "
                        "replicas of its own (serve starts one, speculating with the same "
                        "draft replicas), as NAME or its dir's name (repeatable; any "
                        "tokenizer): a request's `model` chooses, one naming none the first")
    p.add_argument("--routing", choices=ROUTING, default=RouterConfig.routing,
                   help="cache-aware: the replica expected to serve a request soonest, "
                        "counting its cached prefix, its load and speculation (default); "
                        "round-robin: in turn")
    p.add_argument("--max-running-requests", type=int, default=ServiceLimits.max_running,
                   help="generations the router runs at once, gRPC and HTTP together (an "
                        "HTTP request counts its prompts × n); more wait in a queue")
    p.add_argument("--max-queued-requests", type=int, default=ServiceLimits.max_queued,
                   help="generations that may wait for a running slot; beyond, requests are "
                        "refused with RESOURCE_EXHAUSTED / HTTP 429 and a retry hint")
    p.add_argument("--max-queue-wait", type=float, default=ServiceLimits.max_queue_wait_s,
                   metavar="SECONDS", help="longest wait in that queue before the refusal")
    p.add_argument("--max-prompts-per-request", type=int, default=HttpSettings.max_prompts,
                   help="prompts one HTTP completion request may carry")
    p.add_argument("--http-header-timeout", type=float, default=HttpBounds.header_timeout_s,
                   metavar="SECONDS", help="an HTTP connection whose request headers take "
                                           "longer is closed")
    p.add_argument("--http-body-timeout", type=float, default=HttpBounds.body_timeout_s,
                   metavar="SECONDS", help="an HTTP request body that takes longer is "
                                           "refused (408) and its connection closed")
    p.add_argument("--max-body-mb", type=float, default=HttpBounds.max_body_bytes / 2**20,
                   help="larger HTTP request bodies are refused (413) unread")
    p.add_argument("--strict-openai-fields", action="store_true",
                   help="refuse (400) HTTP body fields the API does not know; by default "
                        "they are ignored, counted and named in the X-Outrider-Ignored-Fields "
                        "header, as vLLM ignores them with a warning")
    p.add_argument("--generation-config", choices=("auto", "vllm"),
                   default=RouterConfig.generation_config,
                   help="auto: sampling fields a request leaves unset (temperature, top_p, "
                        "top_k, min_p, repetition_penalty) take the model's "
                        "generation_config.json values, as vLLM's; vllm: the API's own "
                        "defaults")
    p.add_argument("--chat-template",
                   help="the chat template of /v1/chat/completions, a file or the Jinja "
                        "text itself (default: the model's tokenizer_config.json or "
                        "chat_template.jinja)")
    p.add_argument("--tool-call-parser", choices=tuple(CALL_FORMATS),
                   help="the served model's tool-call format, read from its text when a "
                        "chat request offers tools with tool_choice 'auto' (the default); "
                        "without it such requests are a 400 (forced calls need none)")


def serve(cfg: RouterConfig, cluster_token: str | None) -> None:
    """`outrider router`: start, then run until signalled."""
    serve_until_signalled(start(cfg, cluster_token), "router")


def start(cfg: RouterConfig, cluster_token: str | None) -> Running:
    setup_tracing("outrider-router")
    store = open_store(cfg.redis_url)
    env_keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    auth = Authenticator(store, is_required=cfg.require_api_key or bool(env_keys))
    for i, key in enumerate(env_keys):
        auth.add_key(key, st.ApiKeyRecord(name=f"env-{i}", burst=cfg.rate_limit_burst,
                                          requests_per_minute=cfg.rate_limit_rpm))
    if not auth.is_required:
        print("router: no API keys configured; the public port is open", file=sys.stderr)
    replicas = ReplicaSet(store, list(cfg.target_addresses), cluster_token, cfg.heartbeat_s,
                          routing=cfg.routing)
    replicas.start()
    admission = Admission(cfg.limits.max_running, cfg.limits.max_queued,
                          cfg.limits.max_queue_wait_s)
    models = Models([_served_model(cfg, name, model_dir, index == 0, store, replicas, auth,
                                   admission)
                     for index, (name, model_dir) in enumerate(cfg.served)], replicas)
    models.default.service.telemetry.metrics.watch_admission(admission)  # the router's
    if cfg.metrics_port is not None:
        serve_metrics(cfg.host, cfg.metrics_port, "router")  # its own: scraped beside
        #                                   each replica's, it must not repeat theirs
    health_servicer = health.HealthServicer()
    server, bound = build_server(
        lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(models, s),
        [SERVICE_NAME], f"{cfg.host}:{cfg.port}", token=None,
        max_workers=cfg.limits.max_running + cfg.limits.max_queued + CONTROL_THREADS,
        credentials=_tls(cfg), health_servicer=health_servicer)
    # readiness: the Generation service is SERVING while a replica of its models is live
    replicas.on_live = lambda: health_servicer.set(
        SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if models.live()
        else health_pb2.HealthCheckResponse.NOT_SERVING)
    stop_http = _start_http(cfg, models) if cfg.http_port is not None else None
    server.start()

    def close() -> None:
        if stop_http:
            stop_http()
        replicas.close()
        for model in models:
            model.service.close()
            model.service.telemetry.close()
    return Running(server, f"{cfg.host}:{bound}", [close], models)


def _served_model(cfg: RouterConfig, name: str, model_dir: str, is_first: bool,
                  store, replicas: ReplicaSet, auth: Authenticator,
                  admission: Admission) -> ServedModel:
    """One of the router's models: its tokenizer, context, sampling defaults and chat
    template, over its own replicas of the router's."""
    max_model_len = min(context_length(read_config(model_dir)), cfg.max_model_len or sys.maxsize)
    defaults = sampling_defaults(model_dir) if cfg.generation_config == "auto" else {}
    service = GenerationService(Tokenizer(model_dir), max_model_len, store, replicas, auth,
                                cfg.limits, RouterTelemetry(name), defaults, admission,
                                ModelIdentity.of(model_dir).serves)
    # the first model's --chat-template; the others' their own
    template = ChatTemplate.from_dir(model_dir, cfg.chat_template if is_first else None)
    return ServedModel(name, service, template)


def _start_http(cfg: RouterConfig, models: Models):
    app = build_app(models, HttpSettings(cfg.limits.max_running, cfg.max_prompts,
                                         cfg.http_bounds, cfg.strict_fields,
                                         cfg.tool_call_parser))
    server, thread, port = start_http(app, cfg.host, cfg.http_port, cfg.tls_cert,
                                      cfg.tls_key, cfg.tls_client_ca,
                                      cfg.http_bounds.header_timeout_s)
    scheme = "https" if cfg.tls_cert else "http"
    names = ", ".join(repr(m.name) for m in models)
    print(f"router: OpenAI-compatible HTTP API at {scheme}://{cfg.host}:{port}/v1 "
          f"(model{'s' if len(models.served) > 1 else ''} {names})", flush=True)

    def stop() -> None:
        """Open streams end with an error event and `[DONE]`, then uvicorn stops: it
        waits for them to be written (its graceful timeout bounds the wait), since the
        process ends with this call and its daemon thread."""
        app.state.streams.end_all("the router is shutting down: retry on another router")
        server.should_exit = True
        thread.join(timeout=GRACEFUL_STOP_S + 1)
    return stop


def _tls(cfg: RouterConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert:
        return None
    client_ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())],
        root_certificates=client_ca, require_client_auth=client_ca is not None)
