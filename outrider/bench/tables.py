"""The tables a benchmark prints and report.py puts on the pages, each a pure function of
what the benchmark's results JSON holds (no torch, no servers, no benchmark imported):
so a page is rendered from results/*.json alone, and the run that wrote the file printed
the same table."""

from __future__ import annotations

import statistics

# structured's throughput modes (outrider.bench.structured.MODES): the columns of its table
STRUCTURED_MODES = ("constrained", "matched", "unconstrained", "permissive")


# -- numbers -------------------------------------------------------------------------------
def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def sampling_pairs(spec: str) -> dict[str, str]:
    """`temperature=0.8,top_p=0.9` -> {"temperature": "0.8", "top_p": "0.9"} (a vLLM
    client's --sampling, as a versus run's config records it)."""
    pairs = {}
    for pair in filter(None, spec.split(",")):
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--sampling wants NAME=VALUE pairs, got {pair!r}")
        pairs[name.strip()] = value.strip()
    return pairs


# -- targets, the transformers peer (every harness's JSON) ---------------------------------
def targets_table(targets: list[dict]) -> str:
    """A harness's `targets`: what was aimed at, where, the measured value, the threshold
    and whether it was met."""
    lines = ["| target | where | measured | threshold | met |", "|---|---|---|---|---|"]
    for t in targets:
        where = ", ".join(f"{t[k]}" for k in ("workload", "sampling") if k in t)
        if "concurrency" in t:
            c = t["concurrency"]
            where += f"{', ' if where else ''}{c} stream{'s' * (c != 1)}"
            where += f" (best other: {t['best_mode']})" if "best_mode" in t else ""
        sign = "<=" if t.get("higher_is_better") is False else ">="
        met = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {where or '–'} | {fmt(t['value'], 3)} "
                     f"| {sign} {t['threshold']:.4g} | {met} |")
    return "\n".join(lines)


def peer_table(peer: dict, ratios: bool = True) -> str:
    lines = []
    for workload, result in peer["workloads"].items():
        lines += [f"**{workload}** (batch 1, greedy, {peer['max_tokens']} tokens, "
                  f"{peer['threads']} torch threads)", "",
                  "| runner | tok/s | ms/token | output = transformers (prompts) |",
                  "|---|---|---|---|"]
        for name, r in result["runners"].items():
            lines.append(f"| {name} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['ms_per_token'])} "
                         f"| {r['prompts_identical_to_reference']}/{r['prompts']} |")
        if ratios:
            lines += ["", "| ratio | value |", "|---|---|"]
            lines += [f"| {k} | {fmt(v)} |" for k, v in result["ratios"].items()]
        lines.append("")
    return "\n".join(lines)


# -- outrider.bench.serving ----------------------------------------------------------------
def panels(report: dict) -> list[tuple[str, str]]:
    """(workload, sampling) pairs, one subplot each."""
    return sorted({(r["workload"], r["sampling"]) for r in report["rows"]})


def mode_order(report: dict) -> list[str]:
    return report["config"]["modes"]


def gamma_summary(histogram: dict[str, int]) -> str:
    """'γ0 12% γ4 88%': the share of rounds at each γ."""
    total = sum(histogram.values())
    if not total:
        return "–"
    return " ".join(f"γ{g} {100 * n / total:.0f}%" for g, n in histogram.items()
                    if 100 * n / total >= 0.5)


def rows_table(report: dict, workload: str, sampling: str) -> str:
    has_alt = any("bound_alt_c" in r for r in report["rows"])
    head = ("| streams | mode | tok/s | speedup vs off | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
            "| α | mean accepted len | γ distribution | bound | achieved / bound |"
            + (" bound (alt c) | achieved / bound (alt c) |" if has_alt else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = sorted((r for r in report["rows"] if (r["workload"], r["sampling"]) ==
                   (workload, sampling)),
                  key=lambda r: (r["concurrency"], mode_order(report).index(r["mode"])))
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {fmt(r['tokens_per_s'], 1)} "
            f"| {fmt(r['speedup_vs_off'])} | {fmt(r['ttft_ms_p50'], 1)} "
            f"| {fmt(r['itl_ms_p50'])} | {fmt(r['itl_ms_p99'])} "
            f"| {fmt(r['acceptance_rate'], 3)} | {fmt(r['mean_accepted_len'])} "
            f"| {gamma_summary(r['gamma_histogram'])} | {fmt(r['bound'])} "
            f"| {fmt(r['achieved_over_bound'])} |"
            + (f" {fmt(r.get('bound_alt_c'))} | {fmt(r.get('achieved_over_bound_alt_c'))} |"
               if has_alt else ""))
    return "\n".join(lines)


def serving_markdown(report: dict) -> str:
    parts = []
    for workload, sampling in panels(report):
        parts += [f"### {workload}, {sampling}", "", rows_table(report, workload, sampling), ""]
    if report.get("peer"):
        parts += ["### Peer comparison", "", peer_table(report["peer"])]
    parts += ["### Targets", "", targets_table(report["targets"])]
    return "\n".join(parts)


# -- outrider.bench.versus -----------------------------------------------------------------
def versus_table(results: dict[str, dict[int, dict]], rounds: bool = False) -> str:
    """Output tok/s (TTFT p50) per system and level; with `rounds`, each round's tok/s
    beside the mean: '708 (20 ms) [831 / 586]'."""
    levels = sorted({c for cells in results.values() for c in cells})
    lines = ["| system | " + " | ".join(f"{c} stream{'s' * (c != 1)}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for system, cells in results.items():
        row = ["–" if cells.get(c) is None else _versus_cell(cells[c], rounds) for c in levels]
        lines.append(f"| {system} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _versus_cell(x: dict, rounds: bool) -> str:
    text = f"{x['tokens_per_s']:.0f}" + (f" ({x['ttft_ms_p50']:.0f} ms)" if "ttft_ms_p50" in x
                                        else "")
    if rounds and len(x.get("tokens_per_s_rounds", ())) > 1:
        text += " [" + " / ".join(f"{v:.0f}" for v in x["tokens_per_s_rounds"]) + "]"
    return text


def engine_table(results: dict[str, dict[int, dict]]) -> str:
    """Per Outrider system and level, the engine thread's time (engine_cell), as %; and
    where some system ran a speculation cache, the rounds whose drafts it had ready."""
    cells = [(system, c, x) for system, by_level in results.items()
             for c, x in sorted(by_level.items()) if "engine_cpu" in x]
    cached = any((x.get("engine_cache_hits") or 0) > 0 for _, _, x in cells)  # (NaN: no)
    lines = ["| system | streams | steps/s | step ms | in steps | of which on CPU | waiting "
             "for the proposer | waiting otherwise | voluntary switches a step |"
             + (" rounds ready in the speculation cache |" if cached else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if cached else "")]
    for system, c, x in cells:
        lines.append(
            f"| {system} | {c} | {x['engine_steps_per_s']:.0f} | "
            f"{x['engine_step_ms']:.1f} | {x['engine_in_steps']:.0%} | "
            f"{x['engine_cpu']:.0%} | "
            f"{x['engine_proposer_wait']:.0%} | {x['engine_other_wait']:.0%} | "
            f"{x['engine_switches_per_step']:.1f} |"
            + (f" {_share(x.get('engine_cache_hits'))} |" if cached else ""))
    return "\n".join(lines) if len(lines) > 2 else ""



def wait_table(results: dict[str, dict[int, dict]]) -> str:
    """engine_table's columns a speculation cache moves, a cell per level: the step, its
    share waiting for the proposer and the rounds whose drafts the cache had ready."""
    rows = {system: by_level for system, by_level in results.items()
            if any("engine_cpu" in x for x in by_level.values())}
    if not rows:
        return ""
    levels = sorted({c for by_level in rows.values() for c in by_level})
    lines = ["| step ms, waiting for the proposer, rounds ready | "
             + " | ".join(f"{c} stream{'s' * (c != 1)}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for system, by_level in rows.items():
        lines.append(f"| {system} | " + " | ".join(
            f"{x['engine_step_ms']:.1f}, {x['engine_proposer_wait']:.0%}, "
            f"{_share(x.get('engine_cache_hits'))}" if (x := by_level.get(c)) else "–"
            for c in levels) + " |")
    return "\n".join(lines)

# -- outrider.bench.proposers --------------------------------------------------------------
def proposers_table(results: dict[str, dict[str, dict]]) -> str:
    cells = list(next(iter(results.values())))
    lines = ["| system | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    for system, row in results.items():
        lines.append(f"| {system} | " + " | ".join(_proposers_cell(row[k]) for k in cells) + " |")
    return "\n".join(lines)


def _proposers_cell(cell: dict) -> str:
    """'mean (round 1/round 2)' tokens/s."""
    rounds = "/".join(f"{v:.0f}" for v in cell["tokens_per_s_rounds"])
    return f"{cell['tokens_per_s']:.0f} ({rounds})"


# -- outrider.bench.structured -------------------------------------------------------------
def model_rate(cell: dict) -> float | None:
    return cell.get("by_proposer", {}).get("draft_model", {}).get("rate")


def _fixed(value, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _share(value: float | None) -> str:
    """A share as %, "–" where the run did not measure it."""
    return "–" if value is None or value != value else f"{value:.0%}"


def structured_table(results: dict[str, dict], constraints: list[str],
                     constraint_samplings: tuple[str, ...] | None = None) -> str:
    """Validity, tool calls, acceptance (per constraint, in the order of `constraints`'
    names, for `constraint_samplings`, all by default) and throughput, one Markdown table
    each."""
    lines = ["| system | sampling | outputs | valid | invalid (stop) | cut by length | errors |",
             "|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        for sampling, v in r["validity"].items():
            lines.append(f"| {system} | {sampling} | {v['total']} | {v['valid']} | "
                         f"{v['invalid']} | {v['length']} | {v['error']} |")
    lines += ["", "| system | tool choice | calls | valid | invalid | cut by length | errors |",
              "|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        for choice, v in r["tool_calls"].items():
            lines.append(f"| {system} | {choice} | {v['total']} | {v['valid']} | "
                         f"{v['invalid']} | {v['length']} | {v['error']} |")
    lines += ["", "| system | sampling | acceptance constrained | unconstrained | "
              "draft model's: constrained | unconstrained | prompts whose outputs do not loop: "
              "constrained / unconstrained (drafted) |", "|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        for sampling, a in r["acceptance"].items():
            con, unc = a["constrained"], a["unconstrained"]
            no_loops = [c.get("without_loops", {}) for c in (con, unc)]
            text = " / ".join(f"{_fixed(c.get('rate'), 3)} ({_fixed(c.get('draft_tokens'))})"
                              for c in no_loops)
            lines.append(f"| {system} | {sampling} | {_fixed(con['rate'], 3)} | "
                         f"{_fixed(unc['rate'], 3)} | {_fixed(model_rate(con), 3)} | "
                         f"{_fixed(model_rate(unc), 3)} | {text} |")
    lines += constraint_table(results, constraints, constraint_samplings)
    modes = STRUCTURED_MODES
    named = " / ".join(modes)
    lines += ["", f"| system | streams | tok/s: {named} | per stream (1/TPOT): {named} | "
              "tokens per output: constrained / matched | constrained over matched: tok/s / "
              "per stream | permissive over unconstrained, per stream |",
              "|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        for level, cells in r["throughput"].items():
            lines.append(
                f"| {system} | {level.removeprefix('c')} | "
                + " / ".join(_fixed(cells[m]["tokens_per_s"]) for m in modes) + " | "
                + " / ".join(_fixed(cells[m]["per_token_rate"]) for m in modes) + " | "
                + " / ".join(_fixed(cells[m]["mean_tokens"], 1) for m in modes[:2]) + " | "
                + " / ".join(_fixed(ratio(cells["constrained"][k], cells["matched"][k]), 2)
                             for k in ("tokens_per_s", "per_token_rate")) + " | "
                + _fixed(ratio(cells["permissive"]["per_token_rate"],
                               cells["unconstrained"]["per_token_rate"]), 2) + " |")
    return "\n".join(lines)


def constraint_table(results: dict[str, dict], constraints: list[str],
                     samplings: tuple[str, ...] | None = None) -> list[str]:
    """Acceptance per constraint, constrained and not, where the server reported it per
    request (Outrider): which constraints' prompts the grammar helps and which it does not."""
    rows = []
    for system, r in results.items():
        for sampling, a in r["acceptance"].items():
            if samplings is not None and sampling not in samplings:
                continue
            con = a["constrained"].get("by_constraint", {})
            unc = a["unconstrained"].get("by_constraint", {})
            for name in [c for c in constraints if c in con]:
                rate, base = con[name]["rate"], unc.get(name, {}).get("rate")
                rows.append(f"| {system} | {sampling} | {name} | {con[name]['draft_tokens']} | "
                            f"{_fixed(rate, 3)} | {_fixed(base, 3)} | "
                            f"{_fixed(ratio(rate, base), 2)} |")
    if not rows:
        return []
    return ["", "| system | sampling | constraint | drafted (constrained) | acceptance "
            "constrained | unconstrained | ratio |", "|---|---|---|---|---|---|---|", *rows]


# -- outrider.bench.prefix -----------------------------------------------------------------
def prefix_table(results: dict[str, dict]) -> str:
    rows = ["| system | TTFT p50 ms | TTFT p99 ms | TTFT p50 ms, turns 2+ | output tok/s | "
            "hit rate |", "|---|---|---|---|---|---|"]
    for system, r in results.items():
        hit = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        rows.append(f"| {system} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | "
                    f"{r['ttft_ms_p50_later_turns']:.0f} | {r['tokens_per_s']:.1f} | {hit} |")
    return "\n".join(rows)


# -- outrider.bench.step -------------------------------------------------------------------
def step_mode(row: dict) -> str:
    """eager or compiled, and the attention path where the run measured more than one."""
    mode = "compiled" if row["compiled"] else "eager"
    return f"{mode}, {row['attention']}" if "attention" in row else mode


def step_name(row: dict) -> str:
    return (f"{row['kind']} ×{row['batch']}" if row["kind"] != "prefill"
            else f"prefill {row['query_len']}")


def step_table(rows: list[dict]) -> str:
    lines = ["| step | dtype | mode | ms | matmul | attention | other ops | Python | "
             "limit (ms) | of limit |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown_ms"]
        lines.append(f"| {step_name(r)} | {r['dtype']} | "
                     f"{step_mode(r)} | "
                     f"{r['ms']:.2f} | {b['matmul']:.2f} | {b['attention']:.2f} | "
                     f"{b['other_ops']:.2f} | {b['python']:.2f} | "
                     f"{r['ms_at_machine_limit']:.2f} | {r['fraction_of_limit']:.0%} |")
    return "\n".join(lines)


def step_against_reference(rows: list[dict]) -> str:
    """Per step and dtype: ms (attention ms) on the reference path eager (the engine before
    the CPU kernels), the kernels eager and compiled; the best of them against the eager
    float32 reference step, and the kernel's attention against the reference's."""
    at = {(step_name(r), r["dtype"], r["compiled"], r.get("attention", "reference")): r
          for r in rows}
    modes = [(False, "reference"), (False, "kernel"), (True, "kernel")]
    lines = ["| step | dtype | reference, eager | kernels, eager | kernels, compiled | "
             "best vs reference fp32 eager | attention vs reference |",
             "|---|---|---|---|---|---|---|"]
    for name, dtype in dict.fromkeys((step_name(r), r["dtype"]) for r in rows):
        cells = [at.get((name, dtype, *mode)) for mode in modes]
        shown = [f"{c['ms']:.2f} ({c['breakdown_ms']['attention']:.2f})" if c else "–"
                 for c in cells]
        today = at.get((name, "float32", False, "reference"))
        best = min((c["ms"] for c in cells[1:] if c), default=None)
        speedup = f"{today['ms'] / best:.2f}×" if today and best else "–"
        ref, kernel = (c["breakdown_ms"]["attention"] if c else None for c in cells[:2])
        attention = f"{kernel / ref:.2f}×" if ref and kernel else "–"
        lines.append(f"| {name} | {dtype} | {' | '.join(shown)} | {speedup} | {attention} |")
    return "\n".join(lines)


# -- outrider.bench.adapt ------------------------------------------------------------------
def adapt_fifths(requests: list[dict]) -> list[dict]:
    """The stream (the JSON's `requests`) in five equal shares: the output tokens served
    by each share's end, its acceptance (accepted / drafted), mean batch-1 tok/s and the
    draft versions that served it."""
    n = len(requests)
    parts = [requests[i * n // 5:(i + 1) * n // 5] for i in range(5)]
    return [{"served_tokens": part[-1]["served_tokens"],
             "acceptance": sum(r["accepted"] for r in part)
             / max(1, sum(r["drafted"] for r in part)),
             "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in part),
             "versions": (part[0]["version"], part[-1]["version"])} for part in parts if part]
