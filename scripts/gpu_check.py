"""The in-process engine on a CUDA device: is its output the target's, and how fast is it.

    python scripts/gpu_check.py [--device cuda] [--out FILE] [--compile]

Run where a GPU is lent (CI has none). For each dtype (float32, bfloat16) it loads the
shipped demo pair on the device and reports, as JSON:
- `spec_equals_target`: greedy outputs of 8 code prompts with the draft proposing γ=4
  equal those of the target alone (per prompt);
- `device_equals_cpu` (float32): the device's greedy tokens against the CPU reference
  path's, as the share of each output that agrees before the first difference;
- `throughput`: generated tokens/s of `SpeculativeDecoder.generate` at batch 1/8/32/64,
  γ=0 and γ=4, 64 tokens per sequence (ignore_eos), after one warm-up;
- with --compile: the compiled forward's greedy outputs against eager's, and its speed;
- with --served: the served system on the device (router, target and draft replicas as
  processes, as `outrider serve` starts them, the KV caches sized from GPU memory): greedy
  outputs through the router with γ=4 against speculation off, then `outrider bench`'s
  serving sweep (off and auto, code prompts, greedy) at 1, 8, 32 and 64 streams, its JSON
  beside --out. The installed package must be importable (the router is outrider.router).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("outrider") is None:  # a checkout without the package installed
    sys.path.insert(0, str(REPO))

from outrider import paths  # noqa: E402
from outrider.core.sampling import SamplingParams  # noqa: E402
from outrider.core.sequence import Sequence  # noqa: E402
from outrider.engine.kernels import use_cpu_kernels  # noqa: E402
from outrider.engine.local import LocalEngine, LocalEngineConfig  # noqa: E402
from outrider.engine.runner import ModelRunner, RunnerConfig  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, GAMMA = 64, 64, 4
BATCHES = (1, 8, 32, 64)


def code_prompts(engine: LocalEngine, count: int) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of held-out stdlib modules (the bench's code workload)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = paths.heldout_modules_file().read_text().split()
    prompts = []
    for name in names:
        if (stdlib / name).exists():
            ids = engine.tokenizer.encode((stdlib / name).read_text())
            prompts.append(ids[:PROMPT_TOKENS])
    return [prompts[i % len(prompts)] for i in range(count)]


def engine_on(device: str, dtype: str, compile: bool = False) -> LocalEngine:
    target_dir, draft_dir = paths.demo_pair()
    target = RunnerConfig(model_dir=str(target_dir), device=device, dtype=dtype,
                          kv_cache_mb=1024.0, compile=compile)
    return LocalEngine(LocalEngineConfig(target=target, draft_dir=str(draft_dir),
                                         draft_kv_cache_mb=256.0, proposer="model"))


def greedy(engine: LocalEngine, prompts: list[list[int]], gamma: int,
           logprobs: int | None = None) -> list[Sequence]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    return engine.decoder.generate(prompts, params, gamma=gamma)


def ids(seqs: list[Sequence]) -> list[list[int]]:
    return [s.output_ids for s in seqs]


def agreement(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), 1)


def throughput(engine: LocalEngine, prompts: list[list[int]], device: str) -> dict:
    out = {}
    for gamma in (0, GAMMA):
        greedy(engine, prompts[:8], gamma)  # warm-up: allocator, kernels' first launch
        for batch in BATCHES:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = sum(s.num_output for s in greedy(engine, prompts[:batch], gamma))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            out[f"gamma{gamma}_batch{batch}"] = round(tokens / elapsed, 1)
            print(f"  γ={gamma} batch {batch}: {tokens / elapsed:.0f} tok/s", flush=True)
    return out


def splits(alone: list[Sequence], other: list[list[int]]) -> list[dict]:
    """Where an output leaves the target's own: the position, and the target's margin
    between its two likeliest tokens there (a near-tie: a few hundredths in bf16)."""
    out = []
    for i, (seq, tokens) in enumerate(zip(alone, other)):
        at = next((p for p, (a, b) in enumerate(zip(seq.output_ids, tokens)) if a != b), None)
        if at is not None:
            top = seq.logprobs[at].top
            out.append({"prompt": i, "position": at,
                        "top2_margin": round(top[0][1] - top[1][1], 4)})
    return out


def check_dtype(device: str, dtype: str, prompts: list[list[int]], cpu_ref) -> dict:
    with engine_on(device, dtype) as engine:
        alone_seqs = greedy(engine, prompts[:8], 0, logprobs=2)
        alone, spec = ids(alone_seqs), ids(greedy(engine, prompts[:8], GAMMA))
        result = {"spec_equals_target": [a == s for a, s in zip(alone, spec)],
                  "spec_splits": splits(alone_seqs, spec)}
        if cpu_ref is not None:
            result["device_equals_cpu"] = [round(agreement(a, c), 3)
                                           for a, c in zip(alone, cpu_ref)]
        print(f"{dtype}: spec == target {result['spec_equals_target']}", flush=True)
        result["throughput"] = throughput(engine, prompts, device)
    return result, alone


def check_compiled(device: str, prompts: list[list[int]], eager: list[list[int]]) -> dict:
    start = time.perf_counter()
    with engine_on(device, "float32", compile=True) as engine:
        compiled = ids(greedy(engine, prompts[:8], 0))
        result = {"first_run_s": round(time.perf_counter() - start, 1),
                  "equals_eager": [c == e for c, e in zip(compiled, eager)]}
        print(f"compiled: equals eager {result['equals_eager']}", flush=True)
        result["throughput"] = throughput(engine, prompts, device)
    return result


def profile(device: str, dtype: str, prompts: list[list[int]]) -> None:
    """Where a step's time goes: the top ops by self CPU time, at batch 1 and 32."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.startswith("cuda") else [])
    with engine_on(device, dtype) as engine:
        greedy(engine, prompts[:8], 0)
        for batch in (1, 32):
            with torch_profile(activities=activities) as prof:
                greedy(engine, prompts[:batch], 0)
            print(f"--- {dtype} batch {batch}", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
                  flush=True)


def check_kv_from_memory(device: str) -> dict:
    """The KV cache sized from memory on the device (engine/memory.py): what it took, and
    what the device had free before and after."""
    free_before, total = torch.cuda.mem_get_info(device)
    runner = ModelRunner(RunnerConfig(model_dir=str(paths.demo_pair()[0]), device=device,
                                      kv_cache_mb=None, memory_utilization=0.5))
    free_after, _ = torch.cuda.mem_get_info(device)
    used_share = (total - free_after) / total  # of the device, this runner's and others'
    result = {"kv_cache_mib": round(runner.kv_cache_mb), "total_gib": total / 2**30,
              "free_before_gib": free_before / 2**30, "free_after_gib": free_after / 2**30,
              "device_used_share": used_share, "within_share": used_share <= 0.5 + 0.02}
    del runner
    torch.cuda.empty_cache()
    print("kv from memory:", result, flush=True)
    return result


def check_served(device: str, dtype: str, prompts: list[list[int]], out: Path) -> dict:
    from outrider.bench import serving
    from outrider.client import Client
    from outrider.local_system import LocalSystemConfig, local_system

    target, draft = map(str, paths.demo_pair())
    cfg = LocalSystemConfig(target, draft, grpc_port=0, device=device, dtype=dtype,
                            kv_cache_mb=None)
    options = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    with local_system(cfg) as system, Client(system.router, timeout_s=600) as client:
        result = {"start_s": round(time.perf_counter() - start, 1)}
        off = [client.generate(p, speculation="off", **options) for p in prompts[:8]]
        spec = [client.generate(p, speculation="fixed", gamma_max=GAMMA, **options)
                for p in prompts[:8]]
        result["spec_equals_off"] = [a.token_ids == b.token_ids for a, b in zip(off, spec)]
        result["acceptance_rate"] = [round(g.speculation.acceptance_rate, 3) for g in spec]
        print(f"served {dtype}: spec == off {result['spec_equals_off']}", flush=True)
        sweep = out.with_name(f"{out.stem}_served_{dtype}.json")
        serving.main(["--address", system.router, "--target", target, "--draft", draft,
                      "--concurrency", ",".join(map(str, BATCHES)), "--modes", "off,auto",
                      "--workloads", "code", "--samplings", "greedy", "--prompts", "8",
                      "--max-tokens", "128", "--no-plots", "--quiet", "--out", str(sweep)])
        result["streams"] = served_rows(json.loads(sweep.read_text())["rows"])
        print("served", dtype, result["streams"], flush=True)
    return result


def served_rows(rows: list[dict]) -> dict:
    """The sweep's rows by "MODE_STREAMS": tok/s, TTFT p50 and tokens a round."""
    return {f"{r['mode']}_{r['concurrency']}": {
        "tokens_per_s": round(r["tokens_per_s"], 1), "ttft_ms_p50": round(r["ttft_ms_p50"], 1),
        "mean_accepted_len": r["mean_accepted_len"] and round(r["mean_accepted_len"], 2)}
        for r in rows}


def provenance(device: str) -> dict:
    """What ran, where: the commit comes from $OUTRIDER_COMMIT where the tree has no .git
    (the device tool sends the working tree alone)."""
    commit = os.environ.get("OUTRIDER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
        text=True).stdout.strip() or None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"commit": commit, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:]),
            "machine": {"gpu": gpu, "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "torch": torch.__version__,
                        "python": platform.python_version()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--served", metavar="DTYPES",
                        help="also: the served system in these dtypes (comma-separated)")
    parser.add_argument("--profile", metavar="DTYPES",
                        help="instead: profile greedy steps in these dtypes (comma-separated)")
    args = parser.parse_args()
    use_cpu_kernels(False)  # the CPU side is the reference path (no C++ build here)
    report = {"provenance": provenance(args.device)}
    print(report, flush=True)
    with engine_on("cpu", "float32") as cpu:
        prompts = code_prompts(cpu, max(BATCHES))
        if args.profile:
            for dtype in args.profile.split(","):
                profile(args.device, dtype, prompts)
            return
        cpu_ref = ids(greedy(cpu, prompts[:8], 0))
    report["float32"], eager = check_dtype(args.device, "float32", prompts, cpu_ref)
    Path(args.out).write_text(json.dumps(report, indent=1))
    report["bfloat16"], _ = check_dtype(args.device, "bfloat16", prompts, None)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if args.device.startswith("cuda"):
        report["kv_from_memory"] = check_kv_from_memory(args.device)
    if args.compile:
        report["compiled_float32"] = check_compiled(args.device, prompts, eager)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for dtype in (args.served or "").split(",") if args.served else ():
        report[f"served_{dtype}"] = check_served(args.device, dtype, prompts, Path(args.out))
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
