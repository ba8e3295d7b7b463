"""Disaggregated speculation: a target replica and a draft replica as separate processes
on this machine, talking gRPC over loopback, against the same pair in one process.

    python -m outrider.bench.disagg [--prompts 5] [--max-tokens 128] [--gamma 4]

Reports batch-1 greedy tokens/s (γ = 0 and γ = γ, in-process and over gRPC, synchronous
and overlapped: the draft drafting round r+1 while the target verifies round r), the gRPC
cost per round (extra time per round over the in-process loop), and throughput with 8
and 32 concurrent streams. Writes results/disagg.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from outrider import paths
from outrider.bench.common import provenance
from outrider.bench.prompts import heldout_prompts
from outrider.cluster_tls import internal_channel
from outrider.core.sampling import SamplingParams, sampling_to_proto
from outrider.core.tokenizer import Tokenizer
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.grpc_server import token_metadata
from outrider.launch import free_port, outrider_process
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

TOKEN = "bench-token"
GREEDY = SamplingParams()


@contextmanager
def cluster(target_dir: str, draft_dir: str, dense_channel: bool = False,
            overlap_max_seqs: int = 0):
    """A draft and a target worker on loopback; yields a Target stub."""
    dist = ["--dist-address", f"127.0.0.1:{free_port()}"] if dense_channel else []
    target_flags = [*(["--draft-dist-address", dist[1]] if dist else []),
                    "--overlap-max-seqs", str(overlap_max_seqs)]
    with outrider_process("draft-worker", "--model", draft_dir, *dist, token=TOKEN) as (_, d), \
         outrider_process("target-worker", "--model", target_dir, "--draft-address", d,
                          *target_flags, token=TOKEN) as (_, t), \
         internal_channel(t) as channel:
        yield worker_pb2_grpc.TargetStub(channel)


def remote_run(stub, prompt: list[int], gamma: int, max_tokens: int,
               params: SamplingParams = GREEDY) -> tuple[int, int]:
    req = pb.TargetRequest(prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                           sampling=sampling_to_proto(params, params.seed), gamma=gamma,
                           spec_mode=pb.SPEC_MODE_FIXED if gamma else pb.SPEC_MODE_OFF)
    tokens = rounds = 0
    for chunk in stub.Generate(req, metadata=token_metadata(TOKEN), timeout=600):
        tokens += len(chunk.token_ids)
        rounds += len(chunk.rounds)
    return tokens, rounds


def batch1_side_by_side(runs: dict, names: list[str], prompts, gamma: int,
                        max_tokens: int) -> dict[str, dict]:
    """Batch-1 figures for each named run; prompt by prompt, the runs take turns."""
    seconds, tokens, rounds = ({n: 0.0 for n in names} for _ in range(3))
    for i, prompt in enumerate(prompts):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            t, r = runs[name](prompt, gamma, max_tokens)
            seconds[name] += time.perf_counter() - start
            tokens[name] += t
            rounds[name] += r
    return {n: {"tokens_per_s": tokens[n] / seconds[n], "seconds_per_round": seconds[n] / rounds[n],
                "rounds": rounds[n], "tokens": tokens[n]} for n in names}


def concurrent(stub, prompts, gamma: int, max_tokens: int, streams: int,
               params: SamplingParams = GREEDY) -> dict:
    work = [prompts[i % len(prompts)] for i in range(streams)]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda p: remote_run(stub, p, gamma, max_tokens, params), work))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(t for t, _ in done) / seconds,
            "rounds": max(r for _, r in done), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", default="results/disagg.json")
    args = parser.parse_args()
    target_dir, draft_dir = str(paths.demo_target_dir()), str(paths.demo_draft_dir())
    prompts = heldout_prompts(Tokenizer(target_dir), args.prompts, 128)
    local = SpeculativeDecoder(ModelRunner(RunnerConfig(target_dir)),
                               Drafter(ModelRunner(RunnerConfig(draft_dir))))

    def local_run(prompt, gamma, max_tokens):
        seq = local.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             gamma)[0]
        return seq.num_output, seq.stats.num_rounds

    report = {"provenance": provenance(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                         f"torch {torch.__version__}",
              "command": f"python -m outrider.bench.disagg --prompts {args.prompts} "
                         f"--max-tokens {args.max_tokens} --gamma {args.gamma}"}
    # synchronous rounds and rounds drafted ahead, both clusters up at once, every
    # measurement alternating between them so that machine noise hits both alike
    with cluster(target_dir, draft_dir) as sync, \
         cluster(target_dir, draft_dir, overlap_max_seqs=1 << 20) as ahead:
        runs = {"in_process": local_run,
                "grpc": lambda p, g, n: remote_run(sync, p, g, n),
                "grpc_overlap": lambda p, g, n: remote_run(ahead, p, g, n)}
        for run in runs.values():
            run(prompts[0], args.gamma, 16)  # warm-up
        for gamma in (0, args.gamma):
            names = [n for n in runs if gamma or n != "grpc_overlap"]
            report.update({f"{n}_gamma{gamma}": r
                           for n, r in batch1_side_by_side(runs, names, prompts, gamma,
                                                           args.max_tokens).items()})
        spec_local, spec_remote = report[f"in_process_gamma{args.gamma}"], \
            report[f"grpc_gamma{args.gamma}"]
        overhead = spec_remote["seconds_per_round"] - spec_local["seconds_per_round"]
        report["grpc_overhead_ms_per_round"] = overhead * 1e3
        report["grpc_overhead_pct_of_round"] = 100 * overhead / spec_remote["seconds_per_round"]
        for streams in (2, 4, 8, 32):
            for name, stub, gamma in (("", sync, 0), ("", sync, args.gamma),
                                      ("overlap_", ahead, args.gamma)):
                report[f"throughput_{streams}_streams_{name}gamma{gamma}"] = concurrent(
                    stub, prompts, gamma, args.max_tokens, streams)["tokens_per_s"]
    # full-vocabulary sampling: q as fp16 in the gRPC reply vs fp32 over a gloo channel
    hot = SamplingParams(temperature=1.0, seed=5)
    for name, dense_channel in (("grpc_fp16", False), ("gloo_fp32", True)):
        with cluster(target_dir, draft_dir, dense_channel) as stub:
            concurrent(stub, prompts, args.gamma, 16, 8, hot)  # warm-up
            run = concurrent(stub, prompts, args.gamma, args.max_tokens, 8, hot)
            report[f"dense_q_{name}_8_streams"] = {
                "tokens_per_s": run["tokens_per_s"],
                "ms_per_round": 1e3 * run["seconds"] / run["rounds"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
