"""The target's step against the machine's limit: a forward at batch 1, 8 and 32 (decode,
verification of 1+4 tokens per sequence) and a 128-token prefill chunk, eager and
compiled, float32 and bfloat16, each broken into matmuls, attention (cache writes,
context gather, masks, SDPA), other ops and Python, beside what one core allows
(measured oneDNN GEMM throughput at the model's shapes and memory bandwidth).

    python -m outrider.bench.step [--target DIR] [--dtypes float32,bfloat16]
        [--threads 1] [--out results/step.json] [--plots-dir docs/figures]
    (or: outrider bench --step ...)

Contexts are drawn between 128 and 224 cached positions per sequence (the served mix of
128-token prompts and 96-token completions), so the attention masks are as ragged as in
serving. One thread by default: `outrider serve` gives the target one core.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from outrider import paths
from outrider.bench.common import command_line, machine, provenance
from outrider.bench.tables import step_mode, step_name, step_table

if TYPE_CHECKING:  # torch only when measuring: the table and the flags go without it
    import torch

    from outrider.engine.runner import ForwardRequest, ModelRunner

DEFAULT_OUT = "results/step.json"
CASES = [("decode", 1, 1), ("decode", 8, 1), ("decode", 32, 1),
         ("verify", 1, 5), ("verify", 8, 5), ("verify", 32, 5), ("prefill", 1, 128)]
CONTEXT = (128, 224)

MATMUL_OPS = ("mkldnn::_linear_pointwise", "outrider::packed_linear", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
              "outrider_cpu::int4_gemm", "outrider_cpu::int8_gemm", "onednn::qlinear_pointwise")
ATTENTION_OPS = ("outrider_cpu::paged_attention", "aten::index_put_",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::index_select",
                 "aten::index_copy_", "aten::where", "aten::repeat", "aten::masked_fill_",
                 "aten::bitwise_and", "aten::__and__", "aten::le", "aten::lt", "aten::gt")


def machine_limits(dtype: torch.dtype, hidden: int, intermediate: int) -> dict:
    """What one core does at best: oneDNN's prepacked GEMM at the model's widest shape
    (160 rows: a 32-sequence verification) and a streaming copy's bandwidth."""
    import torch

    from outrider.engine.compiled import onednn_linear

    rows, k, n = 160, hidden, 2 * intermediate
    weight = torch.randn(n, k).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    gemm_s = _quartile(lambda: onednn_linear(x, packed), 50)
    source, dest = torch.rand(32 * 2**20), torch.empty(32 * 2**20)  # 128 MB each
    copy_s = _quartile(lambda: dest.copy_(source), 10)
    return {"gemm_gflops": 2 * rows * k * n / gemm_s / 1e9,
            "bandwidth_gbs": 2 * source.numel() * 4 / copy_s / 1e9}


def _quartile(fn, repeats: int) -> float:
    """The lower quartile of `repeats` timed runs after two warm-ups: on a shared machine
    the slow runs measure the neighbours."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 4]


def kv_cache_mb(target: str) -> float:
    """Room for every case's sequences at once, whatever the checkpoint's size (in fp32,
    the widest dtype measured; `--dtypes auto` may be either)."""
    from outrider.engine.model_config import ModelConfig

    mc = ModelConfig.from_dir(target)
    tokens = sum(batch * (CONTEXT[1] + query + 16) for _, batch, query in CASES)
    return max(64.0, 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * tokens / 2**20)


def case_requests(runner: ModelRunner, kind: str, batch: int, query: int,
                  rng: random.Random) -> list[ForwardRequest]:
    from outrider.engine.runner import ForwardRequest

    requests = []
    for k in range(batch):
        cached = 0 if kind == "prefill" else rng.randint(*CONTEXT)
        seq_id = ("bench", kind, batch, k)
        runner.blocks.append(seq_id, cached + query)
        tokens = [rng.randrange(1, runner.vocab_size) for _ in range(query)]
        requests.append(ForwardRequest(tokens, cached, runner.blocks.block_table(seq_id),
                                       1 if kind == "prefill" else query))
    return requests


def forward_cost(runner: ModelRunner, requests: list[ForwardRequest]) -> dict:
    """FLOPs of the linears and of attention, and the weight bytes a forward reads."""
    mc = runner.model_config
    q_width, kv_width = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_token = mc.num_layers * (mc.hidden_size * (2 * q_width + 2 * kv_width)
                                 + 3 * mc.hidden_size * mc.intermediate_size)
    tokens = sum(len(r.token_ids) for r in requests)
    rows = sum(r.num_logits for r in requests)
    head = mc.vocab_size * mc.hidden_size
    attention = sum(4 * mc.num_heads * mc.head_dim * len(r.token_ids)
                    * (r.cached_len + len(r.token_ids)) for r in requests) * mc.num_layers
    return {"matmul_flops": 2 * (per_token * tokens + head * rows),
            "attention_flops": attention,
            "weight_bytes": ((per_token + head) * runner.dtype.itemsize
                             - runner.bytes_saved_by_quantization)}


def breakdown(runner: ModelRunner, requests: list[ForwardRequest], seconds: float) -> dict:
    """Where a forward's time goes, from the profiler's self time per op (compiled
    graphs' own kernels count as other ops); Python and dispatch are what is left."""
    from torch.profiler import profile

    repeats = 10
    with profile() as prof:
        for _ in range(repeats):
            runner.forward(requests)
    parts = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.key_averages():
        part = ("matmul" if event.key in MATMUL_OPS
                else "attention" if event.key in ATTENTION_OPS else "other_ops")
        parts[part] += event.self_cpu_time_total / 1e6 / repeats
    scale = seconds / max(sum(parts.values()), seconds)  # the profiler's own cost taken out
    parts = {k: v * scale for k, v in parts.items()}
    parts["python"] = max(0.0, seconds - sum(parts.values()))
    return parts


def measure(target: str, dtype: str, compiled: bool, attention: str, limits: dict,
            repeats: int) -> list[dict]:
    """Every case at one (dtype, compiled, attention path); attention: 'kernel' (the C++
    paged attention, where it builds) or 'reference' (the pure-torch path)."""
    from outrider.engine.kernels import cpu_kernels_loaded, use_cpu_kernels
    from outrider.engine.runner import ModelRunner, RunnerConfig

    use_cpu_kernels(attention == "kernel")
    if attention == "kernel" and not cpu_kernels_loaded():
        return []

    runner = ModelRunner(RunnerConfig(target, dtype=dtype, compile=compiled,
                                      kv_cache_mb=kv_cache_mb(target)))
    warm_start = time.perf_counter()
    rng = random.Random(0)
    cases = [(kind, batch, query, case_requests(runner, kind, batch, query, rng))
             for kind, batch, query in CASES]
    for *_, requests in cases:
        runner.forward(requests)  # compiles, when compiling
    warm_up_s = time.perf_counter() - warm_start
    rows = []
    for kind, batch, query, requests in cases:
        seconds = _quartile(lambda requests=requests: runner.forward(requests), repeats)
        cost = forward_cost(runner, requests)
        bound = max(cost["matmul_flops"] / (limits["gemm_gflops"] * 1e9),
                    cost["weight_bytes"] / (limits["bandwidth_gbs"] * 1e9))
        rows.append({"kind": kind, "batch": batch, "query_len": query, "dtype": dtype,
                     "compiled": compiled, "attention": attention, "ms": seconds * 1e3,
                     "ms_at_machine_limit": bound * 1e3, "fraction_of_limit": bound / seconds,
                     "breakdown_ms": {k: v * 1e3 for k, v in
                                      breakdown(runner, requests, seconds).items()},
                     **cost})
    return [dict(r, warm_up_s=warm_up_s) for r in rows]


def plot(rows: list[dict], folder: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(step_name(r) for r in rows))
    variants = list(dict.fromkeys((r["dtype"], step_mode(r)) for r in rows))
    ms = {(step_name(r), r["dtype"], step_mode(r)): r["ms"] for r in rows}
    bf16_limit = {step_name(r): r["ms_at_machine_limit"] for r in rows
                  if r["dtype"] == "bfloat16"}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(variants)
    centres = [x + 0.4 - width / 2 for x in range(len(names))]
    for i, (dtype, mode) in enumerate(variants):
        ax.bar([x + i * width for x in range(len(names))],
               [ms[n, dtype, mode] for n in names], width, label=f"{dtype}, {mode}")
    if bf16_limit:
        ax.scatter(centres, [bf16_limit[n] for n in names], marker="_", s=400,
                   color="black", label="bfloat16 machine limit", zorder=3)
    ax.set_xticks(centres, names)
    ax.set_yscale("log")
    ax.set_ylabel("ms per forward (one core)")
    ax.legend(fontsize=8)
    ax.set_title("The demo target's forward, by step shape")
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "step_breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def add_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    if standalone:
        parser.add_argument("--target", default=str(paths.demo_target_dir()))
        parser.add_argument("--out", default=DEFAULT_OUT)
        parser.add_argument("--plots-dir", default=None)
        parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="(--step) the dtypes to measure, comma-separated")
    parser.add_argument("--attention", default="kernel,reference",
                        help="(--step) attention paths: kernel (C++ paged attention) and "
                             "reference (pure torch, the fallback), comma-separated")
    parser.add_argument("--compiled", default="eager,compiled",
                        help="(--step) forward modes: eager, compiled, comma-separated")
    parser.add_argument("--step-repeats", type=int, default=30,
                        help="(--step) timed forwards per case")


def run(args) -> int:
    import torch

    from outrider.engine.model_config import ModelConfig

    torch.set_num_threads(args.threads or 1)
    report = {"provenance": provenance(),
              "machine": machine(), "command": command_line(), "cases": [], "limits": {}}
    mc = ModelConfig.from_dir(args.target)
    report["model"] = {"architecture": mc.architecture, "params": mc.num_params,
                       "experts": mc.num_experts, "experts_per_token": mc.num_experts_per_tok}
    for dtype in args.dtypes.split(","):
        limits = machine_limits(getattr(torch, dtype), mc.hidden_size, mc.intermediate_size)
        report["limits"][dtype] = limits
        for mode in args.compiled.split(","):
            for attention in args.attention.split(","):
                report["cases"] += measure(args.target, dtype, mode == "compiled", attention,
                                           limits, args.step_repeats)
    print(step_table(report["cases"]))
    if args.plots_dir:
        report["plots"] = [plot(report["cases"], Path(args.plots_dir))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
