"""The router in front of a target replica: what it costs per token, and the γ it lets
the policy choose as load rises and falls.

    python -m outrider.bench.router [--prompts 6] [--max-tokens 96] [--ramp-step-s 6]

1. Overhead: the same greedy requests (FIXED γ, so both paths emit the same chunks) sent
   to the router and straight to the target, taking turns; per-token latency (a chunk's
   gap / its tokens) and time to first token, p50 and p99 of each path.
2. Load ramp: AUTO requests from 1 up to --max-streams concurrent streams and back
   down; every round's (heat, γ) from the responses, plotted against time and heat.
Writes results/router_bench.json and results/gamma_vs_heat.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from outrider import paths
from outrider.bench.common import provenance
from outrider.bench.prompts import heldout_prompts
from outrider.client import Client
from outrider.core.sampling import SamplingParams, sampling_to_proto
from outrider.core.tokenizer import Tokenizer
from outrider.grpc_server import token_metadata
from outrider.local_system import LocalSystemConfig, local_system
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

TOKEN = "bench-token"


def timed_chunks(chunks) -> tuple[float, list[tuple[float, int]]]:
    """(start, [(arrival time, tokens in chunk)]) for a stream of messages with token_ids."""
    start, out = time.perf_counter(), []
    for chunk in chunks:
        if chunk.token_ids:
            out.append((time.perf_counter(), len(chunk.token_ids)))
    return start, out


def latencies(start: float, chunks: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """(time to first token, per-token latency of every later token)."""
    ttft = chunks[0][0] - start
    per_token = []
    for (prev, _), (now, n) in zip(chunks, chunks[1:]):
        per_token += [(now - prev) / n] * n
    return ttft, per_token


def overhead(router: str, target: str, prompts, max_tokens: int, gamma: int) -> dict:
    client = Client(router, timeout_s=600)
    stub = worker_pb2_grpc.TargetStub(grpc.insecure_channel(target))
    greedy = SamplingParams()
    paths_ = {
        "router": lambda p: client.stream(p, max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True, speculation="fixed",
                                          gamma_max=gamma),
        "direct": lambda p: stub.Generate(pb.TargetRequest(
            prompt_ids=p, max_tokens=max_tokens, ignore_eos=True,
            sampling=sampling_to_proto(greedy, None), spec_mode=pb.SPEC_MODE_FIXED, gamma=gamma),
            metadata=token_metadata(TOKEN), timeout=600)}
    for run in paths_.values():  # warm-up
        list(run(prompts[0][:8]))
    ttft = {name: [] for name in paths_}
    per_token = {name: [] for name in paths_}
    seconds = {name: 0.0 for name in paths_}
    for i, prompt in enumerate(prompts):
        for name in (paths_ if i % 2 == 0 else list(paths_)[::-1]):
            start, chunks = timed_chunks(paths_[name](prompt))
            first, tokens = latencies(start, chunks)
            ttft[name].append(first)
            per_token[name] += tokens
            seconds[name] += chunks[-1][0] - start
    report = {}
    for name in paths_:
        num_tokens = len(per_token[name]) + len(prompts)
        report[name] = {"per_token_ms_p50": 1e3 * float(np.percentile(per_token[name], 50)),
                        "per_token_ms_p99": 1e3 * float(np.percentile(per_token[name], 99)),
                        "ttft_ms_p50": 1e3 * float(np.percentile(ttft[name], 50)),
                        "ms_per_token_end_to_end": 1e3 * seconds[name] / num_tokens,
                        "tokens": num_tokens}
    for q in ("p50", "p99"):
        report[f"overhead_per_token_ms_{q}"] = (report["router"][f"per_token_ms_{q}"]
                                                - report["direct"][f"per_token_ms_{q}"])
    report["overhead_ms_per_token_end_to_end"] = (report["router"]["ms_per_token_end_to_end"]
                                                  - report["direct"]["ms_per_token_end_to_end"])
    client.close()
    return report


def ramp(router: str, prompts, levels: list[int], step_s: float, max_tokens: int) -> dict:
    """Concurrency follows `levels` (one per step); returns every round's (t, heat, γ)."""
    level = [0]
    rounds: list[tuple[float, float, int]] = []
    lock, stop = threading.Lock(), threading.Event()
    t0 = time.perf_counter()

    def worker(index: int) -> None:
        with Client(router, timeout_s=600) as client:
            k = index
            while not stop.is_set():
                if index >= level[0]:
                    time.sleep(0.05)
                    continue
                for part in client.stream(prompts[k % len(prompts)], max_tokens=max_tokens,
                                          temperature=0.0, ignore_eos=True,
                                          speculation="auto", include_rounds=True):
                    now = time.perf_counter() - t0
                    with lock:
                        rounds.extend((now, r.heat, r.gamma) for r in part.rounds)
                k += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(max(levels))]
    for t in threads:
        t.start()
    schedule = []
    for n in levels:
        level[0] = n
        schedule.append((time.perf_counter() - t0, n))
        time.sleep(step_s)
    stop.set()
    level[0] = 0
    for t in threads:
        t.join(timeout=120)
    return {"rounds": rounds, "schedule": schedule}


def plot(ramp_result: dict, out: Path, max_batch_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, heat, gamma = (np.array(x) for x in zip(*ramp_result["rounds"]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.plot(t, np.minimum(heat, 1.95), ".", ms=2, color="tab:red",
             label="batch heat when γ was chosen (drawn at 1.95 when above 2)")
    top.set_ylim(0, 2)
    streams = ramp_result["schedule"]
    top2 = top.twinx()
    top2.step([s for s, _ in streams], [n for _, n in streams], where="post", color="gray",
              label="concurrent streams")
    top2.set_ylabel("concurrent streams")
    top.axhline(0.9, ls="--", color="tab:red", lw=0.8)
    top.axhline(0.7, ls=":", color="tab:red", lw=0.8)
    top.set_ylabel(f"heat (tokens needed / {max_batch_tokens})")
    top.legend(loc="upper left")
    top2.legend(loc="upper right")
    bins = np.arange(0, t.max() + 1, 1.0)
    idx = np.digitize(t, bins)
    means = [(bins[i - 1] + 0.5, gamma[idx == i].mean()) for i in np.unique(idx)]
    bottom.plot(t, gamma + np.random.default_rng(0).uniform(-0.15, 0.15, len(gamma)), ".",
                ms=2, alpha=0.4, label="γ of each round (jittered)")
    bottom.plot(*zip(*means), color="black", label="mean γ per second")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("γ chosen (AUTO)")
    bottom.legend(loc="upper left")
    fig.suptitle("γ policy during a load ramp (demo pair, CPU): off when hot (≥ 0.9), "
                 "back on when cool (≤ 0.7)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--ramp-step-s", type=float, default=6.0)
    parser.add_argument("--max-streams", type=int, default=40)
    parser.add_argument("--max-batch-tokens", type=int, default=32,
                        help="the target's token budget: heat 1 = this many tokens a step")
    parser.add_argument("--out", default="results/router_bench.json")
    args = parser.parse_args()
    target_dir, draft_dir = str(paths.demo_target_dir()), str(paths.demo_draft_dir())
    tokenizer = Tokenizer(target_dir)
    prompts = heldout_prompts(tokenizer, args.prompts, 128)
    short = [p[:24] for p in heldout_prompts(tokenizer, 20, 24)]
    up = [1, 2, 4, 8, 16, 24, 32, args.max_streams]
    levels = up + up[-2::-1]
    report = {"provenance": provenance(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": f"python -m outrider.bench.router --prompts {args.prompts} "
                         f"--max-tokens {args.max_tokens} --ramp-step-s {args.ramp_step_s} "
                         f"--max-streams {args.max_streams} "
                         f"--max-batch-tokens {args.max_batch_tokens}"}
    cfg = LocalSystemConfig(target_dir, draft_dir, grpc_port=0,
                            max_batch_tokens=args.max_batch_tokens)
    with local_system(cfg, TOKEN) as system:
        report["overhead"] = overhead(system.router, system.target, prompts, args.max_tokens,
                                      args.gamma)
        print(json.dumps(report["overhead"], indent=2), flush=True)
        result = ramp(system.router, short, levels, args.ramp_step_s, args.max_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_name("gamma_vs_heat.png")
    plot(result, png, args.max_batch_tokens)
    heat = np.array([h for _, h, _ in result["rounds"]])
    gamma = np.array([g for _, _, g in result["rounds"]])
    report["ramp"] = {"levels": levels, "step_s": args.ramp_step_s, "rounds": len(heat),
                      "mean_gamma_heat_below_0.7": float(gamma[heat <= 0.7].mean()),
                      "mean_gamma_heat_above_0.9": float(gamma[heat >= 0.9].mean())
                      if (heat >= 0.9).any() else None,
                      "plot": str(png)}
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
