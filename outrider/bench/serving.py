"""`outrider bench`: serving throughput and latency of a live deployment, speculation off,
fixed γ and auto (the router's γ policy), side by side, from 1 to 32 concurrent streams.

    python -m outrider.bench.serving [--address HOST:PORT] [--concurrency 1,2,4,8,16,32]
        [--workloads code,text] [--samplings greedy,t0.7-p0.9]
        [--modes off,fixed2,fixed4,fixed6,auto] [--prompts 4] [--max-tokens 96] [--peer]

Without --address it starts a router, a target replica and a draft replica on the demo
pair (as `outrider serve` does) and stops them at the end. Requests go through the public
gRPC API (`Generation.GenerateStream`) with `include_rounds`, so every delta carries the
rounds behind it (γ, accepted draft tokens, batch heat).

Side by side: at each concurrency level the requests are cut into batches of that many
concurrent streams, and every batch runs once per mode, the modes taking turns (the order
rotates), so machine noise hits every mode alike.

Per (workload, sampling, mode, concurrency): aggregate tokens/s, time to first token p50,
inter-token latency p50/p99 (per token: a delta's gap since the previous delta divided
among its tokens), acceptance rate, mean accepted length, the γ distribution, speedup over
speculation off, and the analytic speedup bound (1 − α^(γ+1)) / ((1 − α)(1 + cγ)) taken
over the rounds' γ distribution, with c = draft / target forward time measured here.
Writes JSON (--out) and PNG plots (--plots-dir); --peer adds the transformers comparison
of outrider.bench.hf_peer at concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from outrider import paths
from outrider.bench.common import (
    SETTINGS,
    Mode,
    RequestRecord,
    build_request,
    call_metadata,
    command_line,
    cpu_pressure,
    decode_forward_seconds,
    deployment,
    machine,
    parse_concurrency,
    parse_list,
    provenance,
    stream_request,
    tag_for,
    target,
)
from outrider.bench.plots import write_plots
from outrider.bench.prompts import WORKLOADS, workload_prompts
from outrider.core.tokenizer import Tokenizer
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc

DEFAULT_MODES = "off,fixed2,fixed4,fixed6,auto"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32"
WARMUP_TOKENS = 16
DEFAULT_OUT = "results/serving.json"


# -- what to run ---------------------------------------------------------------------------
def batches(num_prompts: int, concurrency: int, repeats: int = 1) -> list[list[int]]:
    """Request indices cut into batches of `concurrency` streams: enough batches that
    every prompt runs at least `repeats` times (prompt = index mod num_prompts)."""
    num_batches = max(1, math.ceil(num_prompts / concurrency)) * repeats
    return [list(range(b * concurrency, (b + 1) * concurrency)) for b in range(num_batches)]


def rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


# -- one batch -----------------------------------------------------------------------------
def run_batch(stub, requests: list[gp.GenerateRequest], metadata=(),
              timeout_s: float = 600) -> tuple[list[RequestRecord], float]:
    """All requests at once, one stream each; (records, wall seconds first send → last
    token)."""
    with ThreadPoolExecutor(len(requests)) as pool:
        records = list(pool.map(lambda r: stream_request(stub, r, metadata, timeout_s),
                                requests))
    return records, max(r.end for r in records) - min(r.start for r in records)


# -- statistics (pure) ---------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def per_token_gaps(record: RequestRecord) -> list[float]:
    """Inter-token latency as the client sees it: each delta's gap since the previous
    delta, shared equally among its tokens (a 5-token delta 10 ms after the last one
    gives five 2 ms gaps). The first delta has no gap (that is the TTFT)."""
    gaps = []
    for (prev, _), (now, n) in zip(record.deltas, record.deltas[1:]):
        gaps += [(now - prev) / n] * n
    return gaps


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """1 + α + … + α^γ = (1 − α^(γ+1)) / (1 − α): accepted prefix + recovered/bonus."""
    return sum(alpha ** k for k in range(gamma + 1))


def speedup_bound(alpha: float, gamma: int, c: float) -> float:
    """(1 − α^(γ+1)) / ((1 − α)(1 + cγ)): the batch-1 speedup of speculation over the
    target alone with i.i.d. acceptance α and draft/target cost ratio c (Leviathan et
    al. 2023); free verification, no overheads."""
    return expected_tokens_per_round(alpha, gamma) / (1 + c * gamma)


def mixed_speedup_bound(alpha: float | None, gamma_counts: dict[int, int], c: float) -> float:
    """The bound over rounds with different γ: expected tokens over expected cost (in
    target forwards), round by round; equals speedup_bound for a single γ, 1 when no
    round speculated."""
    alpha = alpha or 0.0
    tokens = sum(n * expected_tokens_per_round(alpha, g) for g, n in gamma_counts.items())
    cost = sum(n * (1 + c * g) for g, n in gamma_counts.items())
    return tokens / cost if cost else 1.0


def summarize(records: list[RequestRecord], seconds: float) -> dict:
    """One cell's figures from its requests and the wall time of its batches."""
    tokens = sum(r.num_tokens for r in records)
    gaps = [g for r in records for g in per_token_gaps(r)]
    draft = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    num_rounds = sum(r.num_rounds for r in records)
    gammas = Counter(g for r in records for g, _ in r.rounds)
    num_round_records = sum(gammas.values())
    return {
        "requests": len(records), "tokens": tokens,
        "completion_tokens": sum(r.completion_tokens for r in records),
        "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft_ms_p50": _ms(percentile([r.ttft for r in records if r.deltas], 50)),
        "itl_ms_p50": _ms(percentile(gaps, 50)), "itl_ms_p99": _ms(percentile(gaps, 99)),
        "draft_tokens": draft, "accepted_tokens": accepted, "rounds": num_rounds,
        "acceptance_rate": accepted / draft if draft else None,
        "mean_accepted_len": (accepted + num_rounds) / num_rounds if num_rounds else None,
        "gamma_histogram": {str(g): gammas[g] for g in sorted(gammas)},
        "mean_gamma": (sum(g * n for g, n in gammas.items()) / num_round_records
                       if num_round_records else None),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def add_comparisons(rows: list[dict], c: float, c_alt: float | None = None) -> None:
    """Speedup over speculation off (same workload, sampling and concurrency), the
    analytic bound for the row's α and γ distribution with cost ratio `c`, and achieved /
    bound; with `c_alt` also the same bound and ratio under the other measure of c."""
    off = {_peers_key(r): r for r in rows if r["mode"] == "off"}
    for row in rows:
        base = off.get(_peers_key(row))
        row["speedup_vs_off"] = (row["tokens_per_s"] / base["tokens_per_s"]
                                 if base and base["tokens_per_s"] else None)
        row["bound"], row["achieved_over_bound"] = _bound_and_ratio(row, c)
        if c_alt is not None:
            row["bound_alt_c"], row["achieved_over_bound_alt_c"] = _bound_and_ratio(row, c_alt)


def _bound_and_ratio(row: dict, c: float) -> tuple[float, float | None]:
    counts = {int(g): n for g, n in row["gamma_histogram"].items()}
    bound = mixed_speedup_bound(row["acceptance_rate"], counts, c)
    speedup = row["speedup_vs_off"]
    return bound, (speedup / bound if speedup is not None else None)


def _peers_key(row: dict) -> tuple:
    return row["workload"], row["sampling"], row["concurrency"]


# -- targets -------------------------------------------------------------------------------
def find_row(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r[k] == v for k, v in match.items())), None)


def batch1_targets(rows: list[dict]) -> list[dict]:
    """Batch 1, greedy code: auto ≥ 2.0x off, achieved/bound ≥ 0.85, ITL ≤ 0.55x off."""
    auto = find_row(rows, workload="code", sampling="greedy", mode="auto", concurrency=1)
    off = find_row(rows, workload="code", sampling="greedy", mode="off", concurrency=1)
    if not auto or not off:
        return []
    itl_ratio = (auto["itl_ms_p50"] / off["itl_ms_p50"]
                 if auto["itl_ms_p50"] and off["itl_ms_p50"] else None)
    out = [target("batch 1 greedy code: auto tokens/s over off", auto["speedup_vs_off"], 2.0),
           target("batch 1 greedy code: auto achieved / analytic bound",
                  auto["achieved_over_bound"], 0.85),
           target("concurrency 1 greedy code: auto ITL p50 over off ITL p50", itl_ratio, 0.55,
                  higher_is_better=False)]
    if auto.get("achieved_over_bound_alt_c") is not None:
        out.insert(2, target("batch 1 greedy code: auto achieved / analytic bound (alt c)",
                             auto["achieved_over_bound_alt_c"], 0.85))
    return out


def load_targets(rows: list[dict]) -> list[dict]:
    """At every (workload, sampling, concurrency): auto ≥ 0.97x the best of off/fixed."""
    out = []
    for row in rows:
        if not row["mode"].startswith("auto"):
            continue
        others = [r for r in rows
                  if _peers_key(r) == _peers_key(row) and not r["mode"].startswith("auto")]
        if not others:
            continue
        best = max(others, key=lambda r: r["tokens_per_s"])
        out.append(target(f"{row['mode']} tokens/s over the best of off and fixed γ",
                          row["tokens_per_s"] / best["tokens_per_s"], 0.97,
                          workload=row["workload"], sampling=row["sampling"],
                          concurrency=row["concurrency"], best_mode=best["mode"]))
    return out


def peer_targets(peer: dict | None) -> list[dict]:
    if not peer or "code" not in peer.get("workloads", {}):
        return []
    ratios = peer["workloads"]["code"]["ratios"]
    return [target("batch 1 greedy code: deployment auto over transformers assisted (best)",
                   ratios.get("deployment_auto_over_hf_assisted_best"), 1.5)]


# -- c and the replica's cost model --------------------------------------------------------
def measure_forward_c(target_dir: str, draft_dir: str, context_len: int) -> dict:
    """c = draft / target time of one batch-1 decode forward after `context_len` tokens,
    in this process (as outrider.bench.acceptance measures it)."""
    from outrider.engine.runner import ModelRunner, RunnerConfig

    times = {name: decode_forward_seconds(ModelRunner(RunnerConfig(model, kv_cache_mb=64)),
                                          context_len)
             for name, model in (("target", target_dir), ("draft", draft_dir))}
    return {"target_forward_ms": 1e3 * times["target"], "draft_forward_ms": 1e3 * times["draft"],
            "c": times["draft"] / times["target"]}


def replica_cost_model(target_address: str | None, token: str | None) -> dict | None:
    """The cost model the target replica measured at start-up (its Load), when the
    harness knows the replica (it started it); None otherwise."""
    if not target_address:
        return None
    from outrider.cluster_tls import internal_channel
    from outrider.grpc_server import token_metadata
    from outrider.v1 import worker_pb2, worker_pb2_grpc

    with internal_channel(target_address) as channel:
        load = worker_pb2_grpc.TargetStub(channel).GetLoad(
            worker_pb2.LoadRequest(), metadata=token_metadata(token), timeout=30)
    cost = load.cost
    fields = ("verify_base_s", "verify_per_token_s", "knee_tokens", "draft_per_position_s",
              "draft_rtt_s")
    out = {f: getattr(cost, f) for f in fields}
    out["c"] = cost.draft_per_position_s / cost.verify_base_s if cost.verify_base_s else None
    out.update(max_batch_tokens=load.max_batch_tokens, gamma_max=load.gamma_max,
               model_pair=load.model_pair)
    return out


def choose_c(forward: dict, replica: dict | None) -> dict:
    """The bound's c: the replica's own cost model (seconds per drafted position /
    a one-token target forward, both as the deployment pays them) when the harness can
    read it, else the raw forward-time ratio measured here; the other one as alt_c."""
    if replica and replica.get("c"):
        return {"c": replica["c"], "source": "replica_cost_model", "alt_c": forward["c"],
                "alt_source": "forward", "forward": forward, "replica_cost_model": replica}
    return {"c": forward["c"], "source": "forward", "alt_c": None, "alt_source": None,
            "forward": forward, "replica_cost_model": replica}


# -- the sweep -----------------------------------------------------------------------------
@dataclass
class Cell:
    records: list[RequestRecord] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Plan:
    prompts: dict[str, list[list[int]]]  # workload -> prompt token ids
    samplings: list[str]
    modes: list[Mode]
    levels: list[int]
    max_tokens: int
    seed: int
    repeats: int = 1

    def num_runs(self) -> int:
        per_level = sum(len(batches(len(p), c, self.repeats)) for p in self.prompts.values()
                        for c in self.levels)
        return per_level * len(self.samplings) * len(self.modes)


def warm_up(stub, plan: Plan, metadata) -> None:
    """One short request per (workload, sampling, mode): JIT/allocator warm-up, and
    AUTO's acceptance prior for each tag starts from real rounds."""
    for workload, prompts in plan.prompts.items():
        for sampling in plan.samplings:
            for mode in plan.modes:
                stream_request(stub, build_request(prompts[0], sampling, mode, WARMUP_TOKENS,
                                                   plan.seed, tag_for(workload, sampling)),
                               metadata)


def sweep(stub, plan: Plan, metadata=(), progress: bool = True) -> list[dict]:
    """Every cell of the plan; modes take turns batch by batch (the order rotating)."""
    cells: dict[tuple, Cell] = {}
    with tqdm(total=plan.num_runs(), desc="bench", unit="run", disable=not progress) as bar:
        for level in plan.levels:
            for workload, prompts in plan.prompts.items():
                for sampling in plan.samplings:
                    for b, indices in enumerate(batches(len(prompts), level, plan.repeats)):
                        for mode in rotated(plan.modes, b + level):
                            bar.set_postfix_str(f"{workload}/{sampling}/{mode.name}/x{level}")
                            requests = [build_request(prompts[i % len(prompts)], sampling, mode,
                                                      plan.max_tokens, plan.seed + i,
                                                      tag_for(workload, sampling))
                                        for i in indices]
                            records, seconds = run_batch(stub, requests, metadata)
                            cell = cells.setdefault((workload, sampling, mode.name, level),
                                                    Cell())
                            cell.records += records
                            cell.seconds += seconds
                            bar.update()
    return [{"workload": w, "sampling": s, "mode": m, "concurrency": c,
             **summarize(cell.records, cell.seconds)}
            for (w, s, m, c), cell in cells.items()]


# -- command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from outrider.local_system import LocalSystemConfig

    parser.add_argument("--address", help="router host:port (default: start a local "
                                          "router + target + draft on --target/--draft)")
    parser.add_argument("--api-key", default=os.environ.get("OUTRIDER_API_KEY"),
                        help="API key for the router (default: $OUTRIDER_API_KEY)")
    parser.add_argument("--target", default=str(paths.demo_target_dir()),
                        help="target checkpoint (tokenizer, c, the local deployment)")
    parser.add_argument("--draft", default=str(paths.demo_draft_dir()),
                        help="draft checkpoint (c, the local deployment)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="code (held-out stdlib modules) and/or text (prose)")
    parser.add_argument("--samplings", default="greedy,t0.7-p0.9",
                        help=f"any of {', '.join(SETTINGS)} (sampled requests are seeded)")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help="off, fixedN (γ = N), auto[N] (γ_max N; plain: replica default)")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                        help="concurrent streams per level, comma-separated")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="code prompts: the first N tokens of each held-out module")
    parser.add_argument("--max-tokens", type=int, default=96,
                        help="tokens per request (ignore_eos: every request makes this many)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every prompt this many times per level (less noise)")
    parser.add_argument("--seed", type=int, default=0, help="request i is seeded seed + i")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads in this process (c; the --peer runs)")
    parser.add_argument("--replica-gamma", type=int, default=LocalSystemConfig.gamma,
                        help="local deployment: the replica's γ (AUTO's default γ_max)")
    parser.add_argument("--max-batch-tokens", type=int, default=LocalSystemConfig.max_batch_tokens,
                        help="local deployment: the target's token budget per step")
    parser.add_argument("--peer", action="store_true",
                        help="also compare with transformers generate / assisted generation "
                             "and the in-process engine at batch 1 (outrider.bench.hf_peer)")
    parser.add_argument("--peer-prompts", type=int, default=None,
                        help="prompts for --peer (default: --prompts)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the results JSON")
    parser.add_argument("--plots-dir", default=None,
                        help="where the PNG plots go (default: the folder of --out)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer(args.target)
    plan = Plan(prompts={w: workload_prompts(tokenizer, w, args.prompts, args.prompt_tokens)
                         for w in parse_list(args.workloads)},
                samplings=[_known_sampling(s) for s in parse_list(args.samplings)],
                modes=[Mode.parse(m) for m in parse_list(args.modes)],
                levels=parse_concurrency(args.concurrency),
                max_tokens=args.max_tokens, seed=args.seed, repeats=args.repeats)
    forward = measure_forward_c(args.target, args.draft, args.prompt_tokens)
    report = {"provenance": provenance(),
              "machine": machine(), "command": command_line(), "config": config_of(args, plan)}
    metadata = call_metadata(args.api_key)
    with deployment(args) as system, grpc.insecure_channel(system.router) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        report["deployment"] = {"router": system.router, "started_here": not args.address}
        report["c"] = choose_c(forward, replica_cost_model(system.target, system.token))
        warm_up(stub, plan, metadata)
        if args.peer:
            report["peer"] = run_peer(args, stub, metadata, tokenizer)
        rows = sweep(stub, plan, metadata, progress=not args.quiet)
    report["machine"].update(load_average_at_end=os.getloadavg(),
                             cpu_pressure_at_end=cpu_pressure())
    add_comparisons(rows, report["c"]["c"], report["c"]["alt_c"])
    report["rows"] = rows
    report["targets"] = (batch1_targets(rows) + peer_targets(report.get("peer"))
                         + load_targets(rows))
    write_report(report, args)
    return 0


def run_peer(args, stub, metadata, tokenizer: Tokenizer) -> dict:
    from outrider.bench import hf_peer

    prompts = workload_prompts(tokenizer, "code", args.peer_prompts or args.prompts,
                               args.prompt_tokens)
    return hf_peer.compare(args.target, args.draft, {"code": prompts}, args.max_tokens,
                           args.replica_gamma, stub=stub, metadata=metadata,
                           progress=not args.quiet)


def write_report(report: dict, args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        report["plots"] = write_plots(report, Path(args.plots_dir or out.parent))
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    for t in report["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        where = ", ".join(f"{k}={t[k]}" for k in ("workload", "sampling", "concurrency")
                          if k in t)
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        sign = ">=" if t["higher_is_better"] else "<="
        print(f"{verdict:>12}: {t['target']} {where} = {value} (target {sign} "
              f"{t['threshold']})", file=sys.stderr)


def _known_sampling(name: str) -> str:
    if name not in SETTINGS:
        raise ValueError(f"unknown sampling {name!r}: use {', '.join(SETTINGS)}")
    return name


def config_of(args, plan: Plan) -> dict:
    return {"workloads": list(plan.prompts), "samplings": {s: SETTINGS[s] for s in plan.samplings},
            "modes": [m.name for m in plan.modes], "concurrency": plan.levels,
            "prompts": {w: len(p) for w, p in plan.prompts.items()},
            "prompt_tokens": {w: statistics.mean(len(x) for x in p)
                              for w, p in plan.prompts.items()},
            "max_tokens": plan.max_tokens, "seed": plan.seed, "repeats": plan.repeats,
            "ignore_eos": True,
            "replica_gamma": args.replica_gamma, "max_batch_tokens": args.max_batch_tokens,
            "itl_definition": "per token: gap between successive deltas / tokens in the delta",
            "bound_definition": "sum over rounds of (1-a^(g+1))/(1-a) / sum of (1+c*g); "
                                "a = accepted/draft tokens of the row, g = each round's γ"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.serving",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
