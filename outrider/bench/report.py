"""Plots and Markdown tables from an `outrider bench` report (results/serving.json).

    python -m outrider.bench.report [results/serving.json] [--plots-dir DIR]

Prints the tables BENCHMARKS.md shows (numbers as measured, only rounded), and with
--plots-dir redraws the PNGs: throughput vs concurrency per mode, inter-token latency vs
concurrency, and speedup over speculation off against the analytic bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PLOT_NAMES = {"throughput": "bench_throughput.png", "itl": "bench_itl.png",
              "speedup": "bench_speedup_vs_bound.png"}


# -- plots ---------------------------------------------------------------------------------
def panels(report: dict) -> list[tuple[str, str]]:
    """(workload, sampling) pairs, one subplot each."""
    return sorted({(r["workload"], r["sampling"]) for r in report["rows"]})


def mode_order(report: dict) -> list[str]:
    return report["config"]["modes"]


def series(rows: list[dict], workload: str, sampling: str, mode: str,
           key: str) -> tuple[list[int], list[float]]:
    """(concurrency levels, values of `key`) of one mode, sorted by concurrency."""
    points = sorted((r["concurrency"], r[key]) for r in rows
                    if (r["workload"], r["sampling"], r["mode"]) == (workload, sampling, mode)
                    and r[key] is not None)
    return [c for c, _ in points], [v for _, v in points]


def _figure(report: dict, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = panels(report)
    ncols = min(2, len(cells))
    nrows = -(-len(cells) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    fig.suptitle(title)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    return fig, list(zip(cells, axes.flat))


def plot_vs_concurrency(report: dict, out: Path, key: str, ylabel: str, title: str,
                        extra_key: str | None = None) -> None:
    """One line per mode (and a dotted one for extra_key, e.g. p99) over concurrency."""
    fig, cells = _figure(report, title)
    for (workload, sampling), ax in cells:
        for i, mode in enumerate(mode_order(report)):
            color = f"C{i}"
            ax.plot(*series(report["rows"], workload, sampling, mode, key), "o-",
                    color=color, label=mode, ms=3)
            if extra_key:
                ax.plot(*series(report["rows"], workload, sampling, mode, extra_key), ":",
                        color=color, lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{workload}, {sampling}")
        ax.grid(alpha=0.3)
    cells[0][1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_speedup_vs_bound(report: dict, out: Path) -> None:
    """Concurrency 1: measured speedup over off next to the analytic bound, per mode."""
    fig, cells = _figure(report, "Concurrency 1: speedup over speculation off vs analytic "
                                 "bound (1-a^(g+1))/((1-a)(1+cg))")
    modes = [m for m in mode_order(report) if m != "off"]
    for (workload, sampling), ax in cells:
        rows = {r["mode"]: r for r in report["rows"] if r["concurrency"] == 1
                and (r["workload"], r["sampling"]) == (workload, sampling)}
        xs = range(len(modes))
        measured = [_or0(rows.get(m, {}).get("speedup_vs_off")) for m in modes]
        bound = [_or0(rows.get(m, {}).get("bound")) for m in modes]
        ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], bound, 0.4, label="bound", alpha=0.6)
        for x, m, b in zip(xs, measured, bound):
            if b:
                ax.annotate(f"{m / b:.2f}", (x, max(m, b)), ha="center", va="bottom",
                            fontsize=8)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(xs), modes)
        ax.set_ylabel("speedup over off (label: measured / bound)")
        ax.set_title(f"{workload}, {sampling}")
    cells[0][1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _or0(value: float | None) -> float:
    return 0.0 if value is None else value


def write_plots(report: dict, folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / filename for name, filename in PLOT_NAMES.items()}
    plot_vs_concurrency(report, files["throughput"], "tokens_per_s", "tokens/s (all streams)",
                        "Aggregate throughput vs concurrency")
    plot_vs_concurrency(report, files["itl"], "itl_ms_p50",
                        "inter-token latency, ms (solid p50, dotted p99)",
                        "Inter-token latency vs concurrency", extra_key="itl_ms_p99")
    plot_speedup_vs_bound(report, files["speedup"])
    return {name: str(path) for name, path in files.items()}


# -- tables --------------------------------------------------------------------------------
def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


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


def targets_table(report: dict) -> str:
    lines = ["| target | where | measured | threshold | met |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        where = ", ".join(f"{t[k]}" for k in ("workload", "sampling") if k in t)
        if "concurrency" in t:
            where += f", {t['concurrency']} streams (best other: {t['best_mode']})"
        sign = ">=" if t["higher_is_better"] else "<="
        met = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {where or '–'} | {fmt(t['value'], 3)} "
                     f"| {sign} {t['threshold']} | {met} |")
    return "\n".join(lines)


def peer_table(peer: dict) -> str:
    lines = []
    for workload, result in peer["workloads"].items():
        lines += [f"**{workload}** (batch 1, greedy, {peer['max_tokens']} tokens, "
                  f"{peer['threads']} torch threads)", "",
                  "| runner | tok/s | ms/token | output = transformers (prompts) |",
                  "|---|---|---|---|"]
        for name, r in result["runners"].items():
            lines.append(f"| {name} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['ms_per_token'])} "
                         f"| {r['prompts_identical_to_reference']}/{r['prompts']} |")
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in result["ratios"].items()]
        lines.append("")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    parts = []
    for workload, sampling in panels(report):
        parts += [f"### {workload}, {sampling}", "", rows_table(report, workload, sampling), ""]
    if report.get("peer"):
        parts += ["### Peer comparison", "", peer_table(report["peer"])]
    parts += ["### Targets", "", targets_table(report)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="?", default="results/serving.json")
    parser.add_argument("--plots-dir", help="redraw the plots into this folder")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    if args.plots_dir:
        write_plots(report, Path(args.plots_dir))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
