"""The `outrider` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from outrider import paths
from outrider.flags import add_compile_arg

EXAMPLES = """examples:
  outrider serve &                      # router + target + draft on this machine
  outrider generate "def fibonacci(n):"  # through the router (127.0.0.1:50051)
  outrider generate --local "def fibonacci(n):"
  outrider generate --local --gamma 0 --max-tokens 32 --json "import os"
  outrider generate --local --temperature 0.7 --top-p 0.95 --seed 1 --stats "class Stack:"
  outrider demo
"""


CLUSTER_EXAMPLES = """examples:
  redis-server --port 6379 --daemonize yes
  outrider up -f deploy/cluster/cpu.yaml     # starts a local Ray head if none runs
  outrider status                            # replicas: node, device, heat, tokens/s
  outrider generate "def fibonacci(n):"
  outrider down                              # drains, removes actors and placement groups
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `outrider` parser. With `command`, only that subcommand gets its flags: the
    roles' come from their modules (outrider.router.main, ...), and `outrider router` need
    not import the target's (torch)."""
    parser = argparse.ArgumentParser(
        prog="outrider", description="Distributed speculative-decoding LLM serving.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_flags, func, options) in SUBCOMMANDS.items():
        subparser = sub.add_parser(name, **options)
        if command is None or command == name:
            add_flags(subparser)
        subparser.set_defaults(func=func)
    return parser


def _subcommand(argv: list[str]) -> str:
    """The subcommand argv names ('' for none): `outrider`'s own options take no value, so
    it is the first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


def _role_flags(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """A role's flags: its module's add_arguments (imported when they are wanted)."""
    return lambda p: importlib.import_module(module).add_arguments(p)


def _generate_flags(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument("--local", action="store_true",
                     help="run the models in this process instead of calling a router")
    gen.add_argument("--address", default="127.0.0.1:50051", help="router host:port")
    gen.add_argument("--tls-ca", help="CA certificate (PEM) when the router uses TLS")
    gen.add_argument("--tls-cert", help="client certificate (PEM) for mTLS")
    gen.add_argument("--tls-key", help="private key (PEM) of --tls-cert")
    gen.add_argument("--timeout", type=float, default=None,
                     help="deadline in seconds (default: none); the API key comes from "
                          "$OUTRIDER_API_KEY")
    gen.add_argument("--speculation", choices=["auto", "off", "fixed"], default=None,
                     help="router mode (default: fixed when --gamma is given, else auto)")
    gen.add_argument("--tag", default="", help="workload tag (acceptance statistics)")
    _add_model_args(gen)
    gen.add_argument("--draft-kv-cache-mb", type=float, default=None,
                     help="KV budget of the draft with --local (default: --kv-cache-mb)")
    _add_sampling_args(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (token_ids, text, stats) instead of streaming")
    gen.add_argument("--stats", action="store_true", help="print acceptance figures to stderr")


def _serve_flags(serve: argparse.ArgumentParser) -> None:
    from outrider.local_system import LocalSystemConfig
    from outrider.router.main import add_public_arguments
    from outrider.target_worker.main import add_batch_arguments

    _add_model_args(serve)
    serve.add_argument("--draft-replicas", type=int, default=LocalSystemConfig.draft_replicas)
    serve.add_argument("--target-replicas", type=int, default=LocalSystemConfig.target_replicas,
                       help="target replicas behind the router (they share the drafts)")
    serve.add_argument("--adapt", action="store_true",
                       help="online distillation: the draft replicas learn from the "
                            "target's tokens while they serve (default: off); with --redis, "
                            "one of them trains and the others pull its versions from there")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=LocalSystemConfig.prefix_caching,
                       help="share the KV of prompts' common prefixes (default: on)")
    serve.add_argument("--grpc-port", type=int, default=LocalSystemConfig.grpc_port,
                       help="the router's port")
    add_batch_arguments(serve)
    serve.add_argument("--no-cpu-pinning", action="store_true",
                       help="let the processes share every core (default on a CPU: the "
                            "target gets cores of its own, drafts and router the rest; "
                            "several target replicas always share every core)")
    add_public_arguments(serve)


def _keys_flags(keys: argparse.ArgumentParser) -> None:
    keys.add_argument("action", choices=["create"])
    keys.add_argument("--redis", required=True, help="redis://host:port/db")
    keys.add_argument("--name", required=True)
    keys.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    keys.add_argument("--burst", type=int, default=10)
    keys.add_argument("--tag", action="append", default=[], help="allowed tag (repeatable)")


def _up_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument("-f", "--file", required=True, help="cluster spec (YAML)")
    up.add_argument("--address", help="Ray cluster address (default: the local one, "
                                      "started if missing; 'auto' inside a Ray job)")
    up.add_argument("--wait", action="store_true",
                    help="stay in the foreground; SIGTERM/Ctrl-C brings it down (RayJob)")


def _down_flags(down: argparse.ArgumentParser) -> None:
    down.add_argument("--address", help="Ray cluster address (default: the local one)")


def _status_flags(status: argparse.ArgumentParser) -> None:
    status.add_argument("--address", default=None,
                        help="router host:port (default: the Ray cluster's controller if one "
                             "runs here, else 127.0.0.1:50051)")
    status.add_argument("--ray-address", help="Ray cluster address for the cluster view")
    status.add_argument("--tls-ca", help="CA certificate (PEM) when the router uses TLS")
    status.add_argument("--tag", default="", help="only this workload tag's statistics")
    status.add_argument("--json", action="store_true", help="print the status as JSON")


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    from outrider.bench import adapt, prefix, serving, step, versus

    serving.add_arguments(bench)
    bench.add_argument("--vllm", help="instead: served Outrider vs its in-process engine vs "
                                      "vLLM with vLLM's load client (outrider.bench.versus); "
                                      "a vLLM venv, or the command that runs vLLM's CLI")
    versus.add_arguments(bench, standalone=False)
    bench.add_argument("--shared-prefix", action="store_true",
                       help="instead: multi-turn conversations over one system prompt, "
                            "prefix caching on and off, cache-aware and round-robin routing "
                            "(with --vllm: vLLM's prefix caching too; outrider.bench.prefix)")
    prefix.add_arguments(bench, standalone=False)
    bench.add_argument("--adapt", action="store_true",
                       help="instead: drafts learning while they serve, acceptance and "
                            "batch-1 speed against tokens served (outrider.bench.adapt)")
    adapt.add_arguments(bench, standalone=False)
    bench.add_argument("--step", action="store_true",
                       help="instead: the target's forward at batch 1/8/32 (decode, "
                            "verification) and a prefill chunk, eager and compiled, per "
                            "dtype, broken down beside the machine's limit "
                            "(outrider.bench.step)")
    step.add_arguments(bench, standalone=False)


def _demo_flags(demo: argparse.ArgumentParser) -> None:
    from outrider.target_worker.main import TargetWorkerConfig

    demo.add_argument("--max-tokens", type=int, default=160)
    demo.add_argument("--gamma", type=int, default=TargetWorkerConfig.gamma)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target checkpoint dir (default: the shipped demo target)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the demo draft when the "
                                   "target is the demo target, else none)")
    p.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per round (0: no speculation; default 4)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the target")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV budget per rank")
    add_compile_arg(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="hold EOS and stop tokens back until this many tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[],
                   dest="stop_token_ids", help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each token's logprob and its K likeliest alternatives "
                        "(with --json)")


def _sampling_options(args) -> dict:
    """The sampling flags as keyword options (SamplingParams' and the SDK's names)."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                repetition_penalty=args.repetition_penalty,
                frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, logit_bias=_logit_bias(args.logit_bias),
                min_tokens=args.min_tokens, stop_token_ids=args.stop_token_ids,
                ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias wants ID=BIAS, got {pair!r}") from None
    return bias


def _engine(args):
    from outrider.engine.local import LocalEngine, LocalEngineConfig
    from outrider.engine.runner import RunnerConfig

    target, draft = _model_dirs(args)
    runner = RunnerConfig(model_dir=str(target), device=args.device, dtype=args.dtype,
                          tp=args.tp, kv_cache_mb=args.kv_cache_mb, compile=args.compile)
    draft_kv = getattr(args, "draft_kv_cache_mb", None) or args.kv_cache_mb
    return LocalEngine(LocalEngineConfig(target=runner, draft_dir=draft if args.gamma else None,
                                         draft_kv_cache_mb=draft_kv))


def _model_dirs(args) -> tuple[Path, str | None]:
    """(target, draft): the shipped demo pair unless told otherwise."""
    target = Path(args.target) if args.target else paths.demo_target_dir(must_exist=True)
    draft = args.draft
    if draft is None and target.resolve() == paths.demo_target_dir().resolve():
        draft = str(paths.demo_draft_dir(must_exist=True))
    if not (target / "config.json").is_file():
        raise UsageError(f"no model at {target} (pass --target DIR)")
    if args.gamma is None:
        from outrider.target_worker.main import TargetWorkerConfig

        args.gamma = TargetWorkerConfig.gamma
    if args.gamma < 0:
        raise UsageError(f"--gamma must be >= 0, got {args.gamma}")
    return target, draft


def _sampling(args):
    from outrider.core.sampling import SamplingParams

    options = _sampling_options(args)
    options.update(logit_bias=tuple(sorted(options["logit_bias"].items())),
                   stop_token_ids=tuple(options["stop_token_ids"]))
    return SamplingParams(**options)


class UsageError(ValueError):
    pass


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    result = (_generate_local if args.local else _generate_remote)(args, prompt)
    if args.json:
        print(json.dumps(result.to_dict()))
    if args.stats:
        print(_stats_line(result), file=sys.stderr)
    return 0


def _generate_local(args, prompt: str):
    from outrider.client.results import Collector
    from outrider.core.sampling import logprobs_to_proto
    from outrider.router.text_stream import TextStream
    from outrider.v1 import generate_pb2 as gp

    params = _sampling(args)
    with _engine(args) as engine:
        text, collector, sent = TextStream(engine.tokenizer, tuple(args.stop)), Collector(), 0
        for seq, new_ids in engine.decoder.stream(engine.tokenizer.encode(prompt), params,  # noqa: B007
                                                  args.gamma):
            delta = text.push(new_ids)
            if text.is_stopped:
                seq.finish_reason = "stop"
                engine.decoder.release(seq)
            elif seq.is_finished:
                delta += text.finish()
            ids, logprobs = (seq.output_ids[sent:text.num_tokens],
                             seq.logprobs[sent:text.num_tokens])
            sent = text.num_tokens
            _echo(args, collector.add(gp.GenerateResponse(
                text=delta, token_ids=ids, logprobs=logprobs_to_proto(logprobs))))
            if seq.is_finished:
                break
        _echo(args, collector.add(_final_message(seq, sent)))
    if not args.json:
        sys.stdout.write("\n")
    return collector.result()


def _final_message(seq, num_sent: int):
    """What a router's last message would say of a sequence generated in this process."""
    from outrider.v1 import generate_pb2 as gp

    return gp.GenerateResponse(
        finish_reason=seq.finish_reason, replica="local",
        usage=gp.Usage(prompt_tokens=seq.prompt_len, completion_tokens=num_sent,
                       cached_prompt_tokens=min(seq.num_cached_tokens or 0, seq.prompt_len)),
        speculation=seq.stats.to_proto())


def _generate_remote(args, prompt: str):
    from outrider.client import Client, Tls

    mode = args.speculation or ("auto" if args.gamma is None else
                                "off" if args.gamma == 0 else "fixed")
    options = dict(_sampling_options(args), stop=args.stop, tag=args.tag, speculation=mode,
                   gamma_max=args.gamma or 0)
    tls = Tls(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca or args.tls_cert else None
    with Client(args.address, tls=tls, timeout_s=args.timeout) as client:
        stream = client.stream(prompt, **options)
        for delta in stream:
            _echo(args, delta)
        result = stream.result()
    if not args.json:
        sys.stdout.write("\n")
    return result


def _echo(args, delta) -> None:
    if not args.json and delta.text:
        sys.stdout.write(delta.text)
        sys.stdout.flush()


def _stats_line(result) -> str:
    """One line of acceptance figures of a Generation (local or through a router)."""
    s, t, n = result.speculation, result.timings, len(result.token_ids)
    per_pos = ", ".join(f"{a / d:.2f}" for a, d in zip(s.accepted_per_position,
                                                        s.drafted_per_position) if d)
    where = f" on {result.replica}" if result.replica != "local" else ""
    return (f"[{n} tokens in {t.total_s:.2f}s = {t.tokens_per_s:.1f} tok/s "
            f"(first after {t.ttft_s * 1000:.0f} ms){where}; rounds {s.rounds}; "
            f"draft tokens {s.draft_tokens}, accepted {s.accepted_tokens} "
            f"(α = {s.acceptance_rate:.3f}; per position: {per_pos or '-'}); "
            f"mean accepted length {s.mean_accepted_len:.2f} tokens/round]")


def cmd_draft_worker(args) -> int:
    from outrider.draft_worker.main import DraftWorkerConfig, serve

    serve(DraftWorkerConfig.from_args(args), cluster_token())
    return 0


def cmd_target_worker(args) -> int:
    from outrider.target_worker.main import TargetWorkerConfig, serve

    serve(TargetWorkerConfig.from_args(args), cluster_token())
    return 0


def cmd_router(args) -> int:
    from outrider.router.main import RouterConfig, serve

    serve(RouterConfig.from_args(args), cluster_token())
    return 0


def cmd_serve(args) -> int:
    import signal
    import threading

    from outrider.local_system import LocalSystemConfig, local_system

    target, draft = _model_dirs(args)
    router_args = [*(["--require-api-key"] if args.require_api_key else []),
                   "--rate-limit-rpm", str(args.rate_limit_rpm),
                   *(["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
                     if args.tls_cert else []),
                   *(["--tls-client-ca", args.tls_client_ca] if args.tls_client_ca else []),
                   *(["--served-model-name", args.served_model_name]
                     if args.served_model_name else []),
                   "--max-running-requests", str(args.max_running_requests),
                   "--routing", args.routing]
    cfg = LocalSystemConfig(str(target), draft if args.gamma else None, args.draft_replicas,
                            args.tp, args.gamma, args.host, args.grpc_port, args.redis,
                            args.device, args.kv_cache_mb, args.max_batch_tokens,
                            args.max_num_seqs, extra_router_args=tuple(router_args),
                            http_port=None if args.no_http else args.http_port,
                            metrics=True, pin_cpus=not args.no_cpu_pinning,
                            target_replicas=args.target_replicas,
                            prefix_caching=args.enable_prefix_caching, adapt=args.adapt,
                            dtype=args.dtype, compile=args.compile)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    with local_system(cfg, cluster_token(), echo=True) as system:
        http = f"; OpenAI-compatible API at http://{system.http}/v1" if system.http else ""
        print(f"outrider serve: router listening on {system.router}{http} "
              "(Ctrl-C stops everything)", flush=True)
        for name, address in system.metrics.items():
            print(f"outrider serve: {name} metrics at http://{address}/metrics", flush=True)
        stopping.wait()
        print("outrider serve: stopping", flush=True)
    return 0


def cmd_bench(args) -> int:
    from outrider.bench import adapt, prefix, serving, step, versus

    if args.step:
        if args.out == serving.DEFAULT_OUT:
            args.out = step.DEFAULT_OUT
        return step.run(args)
    if args.adapt:
        if args.out == serving.DEFAULT_OUT:
            args.out = adapt.DEFAULT_OUT
        return adapt.run(args)
    if args.shared_prefix:
        if args.out == serving.DEFAULT_OUT:
            args.out = prefix.DEFAULT_OUT
        return prefix.run(args)
    if not args.vllm:
        return serving.run(args)
    if args.out == serving.DEFAULT_OUT:
        args.out = versus.DEFAULT_OUT
    return versus.run(args)


def cmd_keys(args) -> int:
    from outrider.router.auth import hash_key, new_key
    from outrider.state import RedisStore
    from outrider.v1 import state_pb2 as st

    key = new_key()
    RedisStore(args.redis).put_api_key(hash_key(key), st.ApiKeyRecord(
        name=args.name, requests_per_minute=args.rpm, burst=args.burst, tags=args.tag))
    print(key)
    return 0


def cmd_up(args) -> int:
    import signal
    import threading

    from outrider.cluster import launch

    endpoints, seconds = launch.up(args.file, args.address)
    where = (f"router listening on {endpoints['router']}"
             + (f"; OpenAI-compatible API at http://{endpoints['http']}/v1"
                if endpoints.get("http") else "") if endpoints["router"]
             else f"target replicas at {', '.join(endpoints['targets'])} (routers run "
                  "elsewhere)")
    print(f"outrider up: {where} ({seconds:.1f} s)", flush=True)
    if args.wait:
        stopping = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopping.set())
        stopping.wait()
        launch.down(args.address)
        print("outrider up: brought down", flush=True)
    return 0


def cmd_down(args) -> int:
    from outrider.cluster import launch

    print("outrider down: " + ("drained and removed" if launch.down(args.address)
                               else "nothing was running"))
    return 0


def cmd_status(args) -> int:
    if args.address is None:
        table = _cluster_status(args.ray_address, args.json)
        if table is not None:
            print(table)
            return 0
        args.address = "127.0.0.1:50051"
    return _router_status(args)


def _cluster_status(ray_address: str | None, as_json: bool = False) -> str | None:
    """The controller's view (a table, or JSON), or None when no Ray cluster with one
    runs here."""
    import ray

    from outrider.cluster import launch

    try:
        handle = launch.controller(ray_address)
    except ConnectionError:
        return None
    if handle is None:
        return None
    status = ray.get(handle.status.remote())
    if as_json:
        return json.dumps(status)
    rows = [("ROLE", "TARGET", "ADDRESS", "NODE", "DEVICE", "PID", "RSS MB", "HEAT", "TOK/S",
             "ALIVE")]
    rows += [(r["role"], str(r["target"]), r["address"], r["node_ip"], r["device"],
              str(r["pid"]), f"{r['rss_mb']:.0f}", _num(r["heat"], 2),
              _num(r["tokens_per_s"], 1), "yes" if r["alive"] else "NO")
             for r in status["rows"]]
    lines = [f"cluster endpoints: {status['endpoints']}", *_columns(rows)]
    router = status["endpoints"].get("router")
    if router:
        from outrider.client import Client

        with Client(router, timeout_s=10) as client:
            lines += _acceptance_lines(client.status())
    return "\n".join(lines + [f"event: {e}" for e in status["events"][-5:]])


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _router_status(args) -> int:
    from google.protobuf.json_format import MessageToDict

    from outrider.client import Client, Tls

    tls = Tls(ca=args.tls_ca) if args.tls_ca else None
    with Client(args.address, tls=tls, timeout_s=10) as client:
        status = client.status(args.tag)
    if args.json:
        print(json.dumps(MessageToDict(status, always_print_fields_with_no_presence=True)))
    else:
        print(_status_table(args.address, status))
    return 0


def _status_table(address: str, status) -> str:
    store = "reachable" if status.is_store_reachable else "UNREACHABLE (serving from snapshot)"
    rows = [("REPLICA", "MODEL PAIR", "HEAT", "RUNNING", "WAITING", "KV BLOCKS", "TOK/S", "SEEN")]
    rows += [(r.address, r.model_pair, f"{r.heat:.2f}", str(r.num_running),
              str(r.num_waiting), f"{r.kv_used_blocks}/{r.kv_total_blocks}",
              f"{r.tokens_per_s:.1f}", f"{r.age_s:.1f}s ago") for r in status.replicas]
    lines = [f"router {address}; shared store {store}; {len(status.replicas)} replica(s)",
             *_columns(rows), *_acceptance_lines(status)]
    return "\n".join(lines)


def _acceptance_lines(status) -> list[str]:
    lines = []
    for a in status.acceptance:
        tested, accepted = sum(a.tested_per_position), sum(a.accepted_per_position)
        per_pos = " ".join(f"{x / t:.2f}" for x, t in zip(a.accepted_per_position,
                                                          a.tested_per_position) if t)
        lines.append(f"acceptance {a.model_pair} tag={a.tag or '-'}: "
                     f"α = {accepted / tested if tested else 0:.3f} over {tested} draft tokens; "
                     f"per position {per_pos or '-'}")
    return lines


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def cluster_token() -> str | None:
    """The cluster's shared token, from the environment (never from argv, which `ps` shows)."""
    import os

    return os.environ.get("OUTRIDER_CLUSTER_TOKEN") or None


def cmd_demo(args) -> int:
    """The whole system on the demo pair: router, target and draft replicas as processes;
    one generation streamed through the router, then the target alone for comparison."""
    from outrider.client import Client
    from outrider.local_system import LocalSystemConfig, local_system

    prompt = _demo_prompt()
    target, draft = paths.demo_pair()
    cfg = LocalSystemConfig(str(target), str(draft), grpc_port=0)
    print("== starting router, target replica and draft replica (processes, gRPC) ==",
          flush=True)
    with local_system(cfg) as system, Client(system.router, timeout_s=600) as client:
        print(f"router listening on {system.router}\n== prompt: the head of held-out module "
              f"{DEMO_MODULE} ==\n{prompt}", flush=True)
        print(f"== through the router: target + draft, greedy, γ = {args.gamma} ==", flush=True)
        options = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        stream = client.stream(prompt, speculation="fixed", gamma_max=args.gamma, **options)
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        spec = stream.result()
        plain = client.generate(prompt, speculation="off", **options)
    print("\n" + _stats_line(spec))
    same = "identical" if plain.token_ids == spec.token_ids else "DIFFERENT"
    print(f"target alone (speculation off): {plain.timings.tokens_per_s:.1f} tok/s; "
          f"speculative speedup {spec.timings.tokens_per_s / plain.timings.tokens_per_s:.2f}x; "
          f"output {same} to the target's own greedy output")
    return 0


DEMO_MODULE = "glob.py"  # a held-out module: never seen in training


def _demo_prompt() -> str:
    """The held-out module's head, up to and including its first function signature."""
    import sysconfig

    lines = Path(sysconfig.get_paths()["stdlib"], DEMO_MODULE).read_text().splitlines()
    first_def = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "\n".join(lines[:first_def + 1]) + "\n"


SUBCOMMANDS = {  # name: (its flags, what runs it, add_parser's options)
    "generate": (_generate_flags, cmd_generate,
                 dict(help="generate text (streams it)", epilog=EXAMPLES,
                      formatter_class=argparse.RawDescriptionHelpFormatter)),
    "draft-worker": (_role_flags("outrider.draft_worker.main"), cmd_draft_worker,
                     dict(help="run one draft replica (gRPC server)")),
    "target-worker": (_role_flags("outrider.target_worker.main"), cmd_target_worker,
                      dict(help="run one target replica (gRPC server)")),
    "router": (_role_flags("outrider.router.main"), cmd_router,
               dict(help="run the public gRPC router")),
    "serve": (_serve_flags, cmd_serve,
              dict(help="router + target + draft worker(s) on this machine")),
    "keys": (_keys_flags, cmd_keys,
             dict(help="create an API key in the shared store (Redis)")),
    "up": (_up_flags, cmd_up,
           dict(help="bring a Ray cluster up from a spec (starts a local Ray when none is "
                     "running)", epilog=CLUSTER_EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter)),
    "down": (_down_flags, cmd_down, dict(help="drain and remove everything `up` started")),
    "status": (_status_flags, cmd_status,
               dict(help="the cluster's replicas (node, device, heat, tokens/s) or a "
                         "router's, with acceptance")),
    "bench": (_bench_flags, cmd_bench,
              dict(help="serving benchmark: speculation off / fixed γ / auto over 1-32 "
                        "streams (JSON + plots)")),
    "demo": (_demo_flags, cmd_demo,
             dict(help="stream a generation from the shipped demo pair")),
}


# the extra of pyproject.toml that installs what each subcommand imports
EXTRA_OF = {"draft-worker": "worker", "target-worker": "worker", "router": "router",
            "keys": "router", "up": "cluster", "down": "cluster", "bench": "bench"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _subcommand(argv)
    try:
        args = build_parser(command).parse_args(argv)
    except ModuleNotFoundError as exc:
        if not _is_third_party(exc):
            raise
        print(f"outrider: error: {_missing_package(exc, command)}", file=sys.stderr)
        return 1
    try:
        if getattr(args, "cpus", None):
            from outrider.cpus import pin_cpus

            pin_cpus(args.cpus)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        message = (_missing_package(exc, command) if _is_third_party(exc)
                   else _one_line(exc))
        print(f"outrider: error: {message}", file=sys.stderr)
        return 1


def _is_third_party(exc: Exception) -> bool:
    """A package an extra installs is missing (not a module of Outrider's own)."""
    return isinstance(exc, ModuleNotFoundError) and not (exc.name or "outrider").startswith(
        "outrider")


def _missing_package(exc: ModuleNotFoundError, command: str) -> str:
    extra = EXTRA_OF.get(command, "all")
    return (f"`outrider {command}` needs the {exc.name!r} package, which this install "
            f"lacks: pip install 'outrider[{extra}]' (on a CPU machine, torch's CPU build "
            "first)")


def _one_line(exc: Exception) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
