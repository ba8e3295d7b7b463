"""The serving benchmark's plots, drawn from its JSON (outrider.bench.serving draws them
as it writes the file, report --serving redraws them): throughput and inter-token
latency against concurrency per mode, and speedup over speculation off against the
analytic bound. (A benchmark whose plots no other module draws keeps them itself.)"""

from __future__ import annotations

from pathlib import Path

from outrider.bench.tables import mode_order, panels

PLOT_NAMES = {"throughput": "bench_throughput.png", "itl": "bench_itl.png",
              "speedup": "bench_speedup_vs_bound.png"}


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
