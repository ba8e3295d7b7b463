"""The `outrider` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from outrider import paths

EXAMPLES = """examples:
  outrider generate --local "def fibonacci(n):"
  outrider generate --local --gamma 0 --max-tokens 32 --json "import os"
  outrider generate --local --temperature 0.7 --top-p 0.95 --seed 1 --stats "class Stack:"
  outrider demo
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outrider", description="Distributed speculative-decoding LLM serving.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (streams it)", epilog=EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument("--local", action="store_true",
                     help="run the models in this process instead of calling a router")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (token_ids, text, stats) instead of streaming")
    gen.add_argument("--stats", action="store_true", help="print acceptance figures to stderr")
    gen.set_defaults(func=cmd_generate)

    draft = sub.add_parser("draft-worker", help="run one draft replica (gRPC server)")
    draft.add_argument("--model", required=True, help="draft checkpoint dir")
    draft.add_argument("--host", default="127.0.0.1")
    draft.add_argument("--port", type=int, default=0, help="0 picks a free port")
    draft.add_argument("--device", default="cpu")
    draft.add_argument("--dtype", default="auto")
    draft.add_argument("--kv-cache-mb", type=float, default=256.0)
    draft.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    draft.add_argument("--idle-ttl-s", type=float, default=300.0,
                       help="free sequences idle this long (they MISS later)")
    draft.add_argument("--dist-address", help="host:port of the co-located target's dense "
                                              "q channel (torch.distributed, gloo on CPU)")
    draft.set_defaults(func=cmd_draft_worker)

    target = sub.add_parser("target-worker", help="run one target replica (gRPC server)")
    target.add_argument("--model", required=True, help="target checkpoint dir")
    target.add_argument("--draft-address", action="append", default=[],
                        help="host:port of a draft replica (repeat for several)")
    target.add_argument("--draft-dist-address",
                        help="host:port to host a dense q channel (torch.distributed) with "
                             "the first draft replica, when it runs on this machine")
    target.add_argument("--gamma", type=int, default=4,
                        help="γ of FIXED requests and γ_max of AUTO ones that set none")
    target.add_argument("--hot-heat", type=float, default=0.9,
                        help="batch heat at which AUTO speculation turns off")
    target.add_argument("--cool-heat", type=float, default=0.7,
                        help="batch heat at which it turns back on (hysteresis)")
    target.add_argument("--overlap-max-seqs", type=int, default=4,
                        help="draft round r+1 while round r verifies when at most this many "
                             "sequences speculate (0: never; it pays in small batches)")
    target.add_argument("--tp", type=int, default=1)
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=0, help="0 picks a free port")
    target.add_argument("--device", default="cpu")
    target.add_argument("--dtype", default="auto")
    target.add_argument("--kv-cache-mb", type=float, default=256.0)
    target.add_argument("--threads", type=int, default=0,
                        help="CPU threads per rank (0: the cores shared out over --tp)")
    target.add_argument("--max-batch-tokens", type=int, default=512)
    target.add_argument("--max-num-seqs", type=int, default=64)
    target.set_defaults(func=cmd_target_worker)

    demo = sub.add_parser("demo", help="stream a generation from the shipped demo pair")
    demo.add_argument("--max-tokens", type=int, default=160)
    demo.add_argument("--gamma", type=int, default=4)
    demo.set_defaults(func=cmd_demo)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target checkpoint dir (default: the shipped demo target)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the demo draft when the "
                                   "target is the demo target, else none)")
    p.add_argument("--gamma", type=int, default=4,
                   help="draft tokens per round (0: no speculation)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the target")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV budget per rank")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)


def _engine(args):
    from outrider.engine.local import LocalEngine, LocalEngineConfig
    from outrider.engine.runner import RunnerConfig

    target = Path(args.target) if args.target else paths.demo_target_dir()
    draft = args.draft
    if draft is None and target.resolve() == paths.demo_target_dir().resolve():
        draft = str(paths.demo_draft_dir())
    if not (target / "config.json").is_file():
        raise UsageError(f"no model at {target} (pass --target DIR)")
    if args.gamma < 0:
        raise UsageError(f"--gamma must be >= 0, got {args.gamma}")
    runner = RunnerConfig(model_dir=str(target), device=args.device, dtype=args.dtype,
                          tp=args.tp, kv_cache_mb=args.kv_cache_mb)
    return LocalEngine(LocalEngineConfig(target=runner,
                                         draft_dir=draft if args.gamma else None))


def _sampling(args):
    from outrider.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed)


class UsageError(ValueError):
    pass


def cmd_generate(args) -> int:
    if not args.local:
        raise UsageError("calling a router is not available in this build; use --local")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _sampling(args)
    with _engine(args) as engine:
        result = _run_stream(engine, prompt, params, args.gamma, echo=not args.json)
    seq, seconds = result
    if args.json:
        print(json.dumps(_result_json(engine, seq, seconds)))
    if args.stats:
        print(_stats_line(seq, seconds), file=sys.stderr)
    return 0


def _run_stream(engine, prompt: str, params, gamma: int, echo: bool):
    from outrider.engine.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(engine.tokenizer)
    start, seq = time.perf_counter(), None
    for seq, new_ids in engine.decoder.stream(engine.tokenizer.encode(prompt), params, gamma):  # noqa: B007
        delta = detok.push(new_ids)
        if echo and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()
    if echo:
        sys.stdout.write("\n")
    return seq, time.perf_counter() - start


def _result_json(engine, seq, seconds: float) -> dict:
    s = seq.stats
    return {
        "token_ids": seq.output_ids,
        "text": engine.tokenizer.decode(seq.output_ids),
        "finish_reason": seq.finish_reason,
        "stats": {
            "draft_tokens": s.num_draft_tokens,
            "accepted_tokens": s.num_accepted_tokens,
            "rounds": s.num_rounds,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_len": s.mean_accepted_len,
            "accepted_per_position": s.accepted_per_position,
            "drafted_per_position": s.drafted_per_position,
        },
        "seconds": seconds,
        "tokens_per_s": seq.num_output / seconds if seconds else 0.0,
    }


def _stats_line(seq, seconds: float) -> str:
    s = seq.stats
    per_pos = ", ".join(f"{a:.2f}" for a in s.acceptance_per_position)
    return (f"[{seq.num_output} tokens in {seconds:.2f}s = {seq.num_output / seconds:.1f} tok/s; "
            f"rounds {s.num_rounds}; draft tokens {s.num_draft_tokens}, accepted "
            f"{s.num_accepted_tokens} (α = {s.acceptance_rate:.3f}; "
            f"per position: {per_pos or '-'}); "
            f"mean accepted length {s.mean_accepted_len:.2f} tokens/round]")


def cmd_draft_worker(args) -> int:
    from outrider.draft_worker.main import serve

    serve(args.model, args.host, args.port, cluster_token(), device=args.device,
          dtype=args.dtype, kv_cache_mb=args.kv_cache_mb, idle_ttl_s=args.idle_ttl_s,
          dist_address=args.dist_address, threads=args.threads)
    return 0


def cmd_target_worker(args) -> int:
    from outrider.engine.runner import RunnerConfig
    from outrider.target_worker.main import TargetWorkerConfig, serve
    from outrider.target_worker.scheduler import SchedulerConfig

    runner = RunnerConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                          tp=args.tp, kv_cache_mb=args.kv_cache_mb, threads=args.threads)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_batch_tokens=args.max_batch_tokens)
    serve(TargetWorkerConfig(runner, sched, tuple(args.draft_address), args.gamma, args.host,
                             args.port, args.draft_dist_address, args.overlap_max_seqs,
                             args.hot_heat, args.cool_heat), cluster_token())
    return 0


def cluster_token() -> str | None:
    """The cluster's shared token, from the environment (never from argv, which `ps` shows)."""
    import os

    return os.environ.get("OUTRIDER_CLUSTER_TOKEN") or None


def cmd_demo(args) -> int:
    from outrider.engine.sampling import SamplingParams

    prompt = _demo_prompt()
    ns = argparse.Namespace(target=None, draft=None, gamma=args.gamma, tp=1, device="cpu",
                            dtype="auto", kv_cache_mb=256.0)
    params = SamplingParams(max_tokens=args.max_tokens)
    with _engine(ns) as engine:
        print(f"== prompt: the head of held-out module {DEMO_MODULE} ==\n{prompt}", flush=True)
        print(f"== target + draft, greedy, γ = {args.gamma} ==", flush=True)
        spec_seq, spec_s = _run_stream(engine, prompt, params, args.gamma, echo=True)
        plain_seq, plain_s = _run_stream(engine, prompt, params, 0, echo=False)
    print(_stats_line(spec_seq, spec_s))
    same = "identical" if plain_seq.output_ids == spec_seq.output_ids else "DIFFERENT"
    print(f"target alone: {plain_seq.num_output / plain_s:.1f} tok/s; speculative speedup "
          f"{plain_s / spec_s * spec_seq.num_output / plain_seq.num_output:.2f}x; "
          f"output {same} to the target's own greedy output")
    return 0


DEMO_MODULE = "glob.py"  # a held-out module: never seen in training


def _demo_prompt() -> str:
    """The held-out module's head, up to and including its first function signature."""
    import sysconfig

    lines = Path(sysconfig.get_paths()["stdlib"], DEMO_MODULE).read_text().splitlines()
    first_def = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "\n".join(lines[:first_def + 1]) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"outrider: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
