"""The shared-prefix chat workload: prefix caching and cache-aware routing, side by side.

    outrider bench --shared-prefix [--vllm VLLM] [--conversations 16] [--turns 4]
        [--system-tokens 500] [--user-tokens 40] [--answer-tokens 48]
        [--parallel-conversations 8] [--target-replicas 2] [--outrider-args ARGS]
        [--systems ...] [--out results/prefix_cache.json] [--plots-dir docs/figures]
    (or: python -m outrider.bench.prefix ...)

Every conversation opens with the same system prompt (the first --system-tokens tokens
of a third-party package's source file), then runs --turns turns one after another: a
user message (the opening of another package file, different per conversation and
turn) and the model's answer, each turn's prompt holding the whole conversation so far.
--parallel-conversations run at once. Greedy, --answer-tokens tokens per answer
(ignore_eos), /v1/completions with streaming, the same client for every system.

Systems:
  outrider-cache-aware   `outrider serve --target-replicas N` (one router), prefix caching
                         on, cache-aware routing (the defaults)
  outrider-round-robin   the same, routing in turn
  outrider-no-cache      prefix caching off (`--no-enable-prefix-caching`)
  vllm-draftG / vllm     `vllm serve --enable-prefix-caching` with / without the draft
                         model, γ = G (with --vllm)

Per system: TTFT p50/p99, output tokens/s over the whole run, and the prefix cache's hit
rate: cached prompt tokens / prompt tokens, from each answer's
usage.prompt_tokens_details.cached_tokens (vLLM reports it with
--enable-prompt-tokens-details). Outputs are checked against the no-cache system's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from outrider import paths
from outrider.bench import common
from outrider.bench.prompts import package_prompts
from outrider.bench.servers import (
    SERVED_NAME,
    base_url,
    outrider_server,
    vllm_server,
    vllm_system,
)
from outrider.bench.tables import prefix_table

DEFAULT_OUT = "results/prefix_cache.json"
OUTRIDER_SYSTEMS = {"outrider-cache-aware": ("--routing", "cache-aware"),
                    "outrider-round-robin": ("--routing", "round-robin"),
                    "outrider-no-cache": ("--no-enable-prefix-caching",)}


@dataclass(frozen=True)
class Workload:
    system: str
    users: list[list[str]]  # [conversation][turn]
    max_tokens: int


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    text: str


def build_workload(tokenizer, args) -> Workload:
    texts = package_prompts(tokenizer, 1 + args.conversations * args.turns,
                            max(args.system_tokens, args.user_tokens))
    system = texts[0] if args.system_tokens >= args.user_tokens else tokenizer.decode(
        tokenizer.encode(texts[0])[:args.system_tokens])
    clip = lambda text: tokenizer.decode(tokenizer.encode(text)[:args.user_tokens])  # noqa: E731
    users = [[f"\n\n# --- user {c}.{t} ---\n" + clip(texts[1 + c * args.turns + t])
              for t in range(args.turns)] for c in range(args.conversations)]
    return Workload(system, users, args.answer_tokens)


# -- the client ------------------------------------------------------------------------------
def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, dict, str, float]:
    """One streamed /v1/completions call: (TTFT s, usage, text, latency s)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start, first, usage, parts = time.perf_counter(), None, {}, []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            text = "".join(c.get("text", "") for c in event.get("choices", []))
            if text and first is None:
                first = time.perf_counter()
            parts.append(text)
            usage = event.get("usage") or usage
    end = time.perf_counter()
    return (first or end) - start, usage, "".join(parts), end - start


def run_conversation(url: str, work: Workload, c: int) -> list[Turn]:
    history, turns = work.system, []
    for t, user in enumerate(work.users[c]):
        history += user
        ttft, usage, text, latency = complete(url, history, work.max_tokens)
        details = usage.get("prompt_tokens_details") or {}
        turns.append(Turn(c, t, ttft, latency, usage.get("prompt_tokens", 0),
                          details.get("cached_tokens"), usage.get("completion_tokens", 0), text))
        history += text
    return turns


def run_workload(url: str, work: Workload, concurrency: int) -> dict:
    complete(url, "def warm_up(x):\n    return", 4)  # not the shared prefix: caches stay cold
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        conversations = list(pool.map(lambda c: run_conversation(url, work, c),
                                      range(len(work.users))))
    wall = time.perf_counter() - start
    return summarise([t for conv in conversations for t in conv], wall)


def summarise(turns: list[Turn], wall_s: float) -> dict:
    ttfts = sorted(t.ttft_s * 1000 for t in turns)
    later = [t.ttft_s * 1000 for t in turns if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = [t.cached_tokens for t in turns]
    return {"requests": len(turns), "wall_s": wall_s,
            "tokens_per_s": sum(t.completion_tokens for t in turns) / wall_s,
            "ttft_ms_p50": statistics.median(ttfts),
            "ttft_ms_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "ttft_ms_p50_later_turns": statistics.median(later) if later else None,
            "latency_s_p50": statistics.median(t.latency_s for t in turns),
            "prompt_tokens": prompt,
            "hit_rate": (sum(cached) / prompt if prompt and None not in cached else None),
            "turns": [asdict(t) for t in turns]}


# -- systems and report ------------------------------------------------------------------------
def measure(args, system: str, work: Workload, log) -> dict:
    log(f"{system}: starting")
    if system in OUTRIDER_SYSTEMS:
        extra = ("--target-replicas", str(args.target_replicas), *OUTRIDER_SYSTEMS[system],
                 *args.outrider_args.split())
        server = base_url(outrider_server(args, extra))
    else:
        server = base_url(vllm_server(args, vllm_system(system != "vllm", args.gamma),
                                      ("--enable-prefix-caching",
                                       "--enable-prompt-tokens-details")))
    with server as url:
        result = run_workload(url, work, args.parallel_conversations)
    log(f"{system}: TTFT p50 {result['ttft_ms_p50']:.0f} ms, {result['tokens_per_s']:.1f} "
        f"tok/s, hit rate {result['hit_rate']}")
    return result


@contextmanager
def same_outputs(results: dict[str, dict], reference: str) -> dict[str, float]:
    """Per system, the fraction of answers identical to `reference`'s (greedy)."""
    if reference not in results:
        return {}
    ref = {(t["conversation"], t["turn"]): t["text"] for t in results[reference]["turns"]}
    return {s: sum(ref.get((t["conversation"], t["turn"])) == t["text"] for t in r["turns"])
            / len(r["turns"]) for s, r in results.items()}


def targets(results: dict[str, dict]) -> list[dict]:
    def ratio(a: str, b: str, key: str, invert: bool = False):
        if a not in results or b not in results:
            return None
        x, y = results[a][key], results[b][key]
        return (y / x) if invert else (x / y)

    checks = [("TTFT p50 without cache / with cache-aware cache", ratio(
                   "outrider-cache-aware", "outrider-no-cache", "ttft_ms_p50", invert=True), 3.0),
              ("throughput with cache-aware cache / without cache", ratio(
                  "outrider-cache-aware", "outrider-no-cache", "tokens_per_s"), 1.5),
              ("hit rate, cache-aware routing", results.get("outrider-cache-aware", {}).get(
                  "hit_rate"), 0.8)]
    return [{"target": name, "value": value, "threshold": threshold,
             "met": value is not None and value >= threshold}
            for name, value, threshold in checks]


def plot(results: dict[str, dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("ttft_ms_p50", "tokens_per_s", "hit_rate"),
                              ("TTFT p50 (ms)", "output tokens/s", "prefix cache hit rate")):
        ax.bar(range(len(names)), [results[n][key] or 0 for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)


# -- command line ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    if standalone:
        parser.add_argument("--vllm", help="the vllm command (python vllm_cli.py) for vLLM rows")
        parser.add_argument("--target", default=str(paths.demo_target_dir()))
        parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
        parser.add_argument("--gamma", type=int, default=4)
        parser.add_argument("--systems", default=None)
        parser.add_argument("--out", default=DEFAULT_OUT)
        parser.add_argument("--plots-dir", default=None)
    parser.add_argument("--conversations", type=int, default=16, help="(shared-prefix)")
    parser.add_argument("--parallel-conversations", type=int, default=8,
                        help="conversations at once (shared-prefix)")
    parser.add_argument("--turns", type=int, default=4, help="(shared-prefix)")
    parser.add_argument("--system-tokens", type=int, default=500,
                        help="shared system prompt (shared-prefix)")
    parser.add_argument("--user-tokens", type=int, default=40,
                        help="per user message (shared-prefix)")
    parser.add_argument("--answer-tokens", type=int, default=48,
                        help="per answer (shared-prefix)")
    parser.add_argument("--target-replicas", type=int, default=2,
                        help="target replicas behind Outrider's router (shared-prefix)")
    parser.add_argument("--outrider-args", default="",
                        help="more `outrider serve` flags for the Outrider rows (shared-prefix)")


def run(args) -> int:
    from outrider.core.tokenizer import Tokenizer

    started = common.provenance()  # the commit and date the run began with
    systems = common.parse_list(args.systems or ",".join(
        [*OUTRIDER_SYSTEMS, *([f"vllm-draft{args.gamma}", "vllm"] if args.vllm else [])]))
    unknown = [s for s in systems if s not in OUTRIDER_SYSTEMS and not s.startswith("vllm")]
    if unknown or (any(s.startswith("vllm") for s in systems) and not args.vllm):
        raise SystemExit(f"unknown systems {unknown} (vLLM rows need --vllm)" if unknown
                         else "vLLM rows need --vllm")
    work = build_workload(Tokenizer(args.target), args)
    log = lambda text: print(f"[shared-prefix] {text}", file=sys.stderr, flush=True)  # noqa: E731
    results = {s: measure(args, s, work, log) for s in systems}
    report = {"provenance": started,
              "machine": common.machine(), "command": common.command_line(),
              "config": {k: getattr(args, k) for k in (
                  "conversations", "turns", "system_tokens", "user_tokens", "answer_tokens",
                  "parallel_conversations", "target_replicas", "gamma", "outrider_args")},
              "results": results, "same_output_as_no_cache": same_outputs(
                  results, "outrider-no-cache"), "targets": targets(results)}
    if args.plots_dir:
        report["plot"] = plot(results, Path(args.plots_dir) / "prefix_cache.png")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(prefix_table(results))
    for t in report["targets"]:
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        print(f"{'met ' if t['met'] else 'MISS'} {t['target']}: {value} (>= {t['threshold']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.prefix",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
