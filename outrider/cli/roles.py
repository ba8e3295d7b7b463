"""Starting the serving processes: one role each (router, target-worker, draft-worker),
or all of them on this machine (serve)."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable

from outrider.cli.common import add_model_args, model_dirs, stop_on_signals


def role_flags(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """A role's flags: its module's add_arguments, imported only when they are wanted (the
    target's pull in torch, which a router's machine may lack)."""
    return lambda p: importlib.import_module(module).add_arguments(p)


def cluster_token() -> str | None:
    """The cluster's shared token, from the environment (never from argv, which `ps` shows)."""
    return os.environ.get("OUTRIDER_CLUSTER_TOKEN") or None


def cmd_draft_worker(args) -> int:
    from outrider.draft_worker.main import DraftWorkerConfig, serve

    serve(DraftWorkerConfig.from_args(args), cluster_token())
    return 0


def cmd_target_worker(args) -> int:
    from outrider.target_worker.main import TargetWorkerConfig, serve

    serve(TargetWorkerConfig.from_args(args), cluster_token())
    return 0


def cmd_router(args) -> int:
    from outrider.allocator import run_on_jemalloc
    from outrider.router.main import RouterConfig, serve

    run_on_jemalloc()
    serve(RouterConfig.from_args(args), cluster_token())
    return 0


def serve_flags(serve: argparse.ArgumentParser) -> None:
    from outrider.flags import add_proposer_arg, add_self_draft_arg, unit_share
    from outrider.local_system import LocalSystemConfig
    from outrider.router.main import add_public_arguments
    from outrider.target_worker.main import add_batch_arguments

    add_model_args(serve, model_positional=True)
    serve.add_argument("--draft-replicas", type=int, default=LocalSystemConfig.draft_replicas,
                       help="draft replicas (processes) the target replicas share")
    serve.add_argument("--head-on-replicas", action="store_true",
                       help="with an EAGLE-3 or EAGLE-1 head as --draft: it drafts on "
                            "--draft-replicas draft replicas, the target sending its "
                            "features with each Propose (default: in the target's process)")
    serve.add_argument("--target-replicas", type=int, default=LocalSystemConfig.target_replicas,
                       help="target replicas behind the router (they share the drafts)")
    serve.add_argument("--also-draft", action="append", default=[], metavar="DIR",
                       help="another draft model for the target (repeatable; any tokenizer): "
                            "on --draft-replicas replicas of its own, with --target-replicas "
                            "target replicas speculating with it; the router sends each "
                            "request where its acceptance and cost say it is served soonest")
    serve.add_argument("--speculation-cache", action=argparse.BooleanOptionalAction,
                       default=LocalSystemConfig.speculation_cache,
                       help="the draft replicas draft the next round for its likely "
                            "outcomes while the target verifies (draft-worker's flag)")
    serve.add_argument("--cache-aware-sampling", type=unit_share, metavar="WEIGHT",
                       help="with --speculation-cache: sampled rows too, drafted cache-aware "
                            "(draft-worker's flag)")
    serve.add_argument("--adapt", action="store_true",
                       help="online distillation: the draft replicas learn from the "
                            "target's tokens while they serve (default: off); with --redis, "
                            "one of them trains and the others pull its versions from there")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=LocalSystemConfig.prefix_caching,
                       help="share the KV of prompts' common prefixes (default: on)")
    serve.add_argument("--grpc-port", type=int, default=LocalSystemConfig.grpc_port,
                       help="the router's gRPC port")
    serve.add_argument("--api-key", action="append", default=[],
                       help="a key clients must send (Authorization: Bearer KEY; repeatable; "
                            "added to $OUTRIDER_API_KEYS, which the router reads)")
    add_batch_arguments(serve)
    add_proposer_arg(serve)
    add_self_draft_arg(serve)
    serve.add_argument("--no-cpu-pinning", action="store_true",
                       help="let the processes share every core (default on a CPU: the "
                            "target gets cores of its own, drafts and router the rest; "
                            "several target replicas always share every core)")
    # as vLLM's: every interface (a container's published port answers); the
    # workers behind the router stay on loopback
    add_public_arguments(serve, http_port_flags=("--port", "--http-port"), host="0.0.0.0")


def cmd_serve(args) -> int:
    from outrider.grpc_server import wait_until_set
    from outrider.local_system import local_system

    cfg = _local_system_config(args)
    stopping = stop_on_signals()
    with local_system(cfg, cluster_token(), echo=True, env=_api_keys_env(args),
                      stopping=stopping) as system:
        http = f"; OpenAI-compatible API at http://{system.http}/v1" if system.http else ""
        print(f"outrider serve: router listening on {system.router}{http} "
              "(Ctrl-C stops everything)", flush=True)
        for name, address in system.metrics.items():
            print(f"outrider serve: {name} metrics at http://{address}/metrics", flush=True)
        wait_until_set(stopping)
        print("outrider serve: stopping", flush=True)
    return 0


def _local_system_config(args):
    from outrider.flags import ngram_sizes_of_args, tree_shape
    from outrider.local_system import LocalSystemConfig

    target, draft = model_dirs(args)
    return LocalSystemConfig(str(target), draft if args.gamma else None, args.draft_replicas,
                             args.tp, args.gamma, args.host, args.grpc_port, args.redis,
                             args.device, args.kv_cache_mb, args.max_batch_tokens,
                             args.max_num_seqs, extra_router_args=_router_args(args),
                             http_port=None if args.no_http else args.http_port,
                             metrics=True, pin_cpus=not args.no_cpu_pinning,
                             target_replicas=args.target_replicas,
                             prefix_caching=args.enable_prefix_caching, adapt=args.adapt,
                             dtype=args.dtype, compile=args.compile,
                             enforce_eager=args.enforce_eager,
                             max_model_len=args.max_model_len,
                             quantization=args.quantization,
                             memory_utilization=args.gpu_memory_utilization,
                             tree_topk=tree_shape(args).topk,
                             tree_tokens=args.tree_tokens,
                             head_on_replicas=args.head_on_replicas,
                             speculation_cache=args.speculation_cache,
                             cache_aware_sampling=args.cache_aware_sampling,
                             self_draft_layers=args.self_draft_layers if args.gamma else None,
                             ngram_sizes=ngram_sizes_of_args(args),
                             also_serve=tuple(str(d) for d in args.also_serve),
                             also_draft=tuple(args.also_draft) if args.gamma else (),
                             # --gamma 0: no speculation, so nothing proposes
                             proposer=args.proposer if args.gamma else "model")


def _api_keys_env(args) -> dict[str, str] | None:
    """--api-key's keys beside $OUTRIDER_API_KEYS's, for the router (in its environment,
    not on its command line, which `ps` shows)."""
    from outrider.router.main import API_KEYS_ENV

    if not args.api_key:
        return None
    keys = [k for k in os.environ.get(API_KEYS_ENV, "").split(",") if k] + args.api_key
    return {API_KEYS_ENV: ",".join(keys)}


def _router_args(args) -> tuple[str, ...]:
    """The router's public flags of `serve`, passed on to the router process's command line."""
    return (*(["--require-api-key"] if args.require_api_key else []),
            "--rate-limit-rpm", str(args.rate_limit_rpm),
            *(["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
              if args.tls_cert else []),
            *(["--tls-client-ca", args.tls_client_ca] if args.tls_client_ca else []),
            *(["--served-model-name", args.served_model_name]
              if args.served_model_name else []),
            "--max-running-requests", str(args.max_running_requests),
            "--max-queued-requests", str(args.max_queued_requests),
            "--max-queue-wait", str(args.max_queue_wait),
            "--max-prompts-per-request", str(args.max_prompts_per_request),
            "--http-header-timeout", str(args.http_header_timeout),
            "--http-body-timeout", str(args.http_body_timeout),
            "--max-body-mb", str(args.max_body_mb),
            "--routing", args.routing,
            *(["--strict-openai-fields"] if args.strict_openai_fields else []),
            *(["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []),
            "--generation-config", args.generation_config,
            *(["--chat-template", args.chat_template] if args.chat_template else []))
