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
- `fp8`: the demo target quantized as it loads (`-q fp8`), bf16: its linears' kernel
  (FP8 tensor cores where the device has them), speculation's greedy output against its
  own, and its throughput; `w4a16` the same for the shipped 4-bit demo target (tinygemm
  where the device has it), `w8a8` for a W8A8 copy of the demo target written at start
  (scripts/quantize_checkpoint.py; torch._int_mm);
- with --compile: the compiled forward's greedy outputs against eager's, and its speed;
- with --mid SIZE, first: a random Llama of SIZE (1b: Llama-3.2-1B's shape) written on
  the device with a draft of its first layer; its decode step at batch 1/32/64 from CUDA
  graphs (and eager at 1) against the roofline (the bytes of weights and KV a step reads
  over the device's copy bandwidth); the draft at γ 4 against speculation off; greedy
  agreement; then transformers' generate on it at batch 1 (dynamic cache, static cache
  compiled, assisted by the same draft) against Outrider's;
- on CUDA every throughput also eager (--enforce-eager): graphs against eager;
- with --served: the served system on the device (router, target and draft replicas as
  processes, as `outrider serve` starts them, the KV caches sized from GPU memory): greedy
  outputs through the router with γ=4 against speculation off, then `outrider bench`'s
  serving sweep (off and auto, code prompts, greedy) at 1, 8, 32 and 64 streams, its JSON
  beside --out. The installed package must be importable (the router is outrider.router).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
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
from outrider.engine.kernels import triton_paged, use_cpu_kernels  # noqa: E402
from outrider.engine.local import LocalEngine, LocalEngineConfig  # noqa: E402
from outrider.engine.model_config import ModelConfig  # noqa: E402
from outrider.engine.runner import ModelRunner, RunnerConfig  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, GAMMA = 64, 64, 4
BATCHES = (1, 8, 32, 64)
MID_BATCHES = (1, 32, 64)


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


def engine_on(device: str, dtype: str, compile: bool = False, enforce_eager: bool = False,
              quantization: str | None = None, target_dir: Path | None = None) -> LocalEngine:
    demo_target, draft_dir = paths.demo_pair()
    target_dir = target_dir or demo_target
    target = RunnerConfig(model_dir=str(target_dir), device=device, dtype=dtype,
                          kv_cache_mb=1024.0, compile=compile, enforce_eager=enforce_eager,
                          quantization=quantization)
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
        result["graph_capture_s"] = round(engine.decoder.target.graph_capture_s, 1)
    if device.startswith("cuda"):
        with engine_on(device, dtype, enforce_eager=True) as engine:
            eager = ids(greedy(engine, prompts[:8], 0))
            result["graphs_equal_eager"] = [a == e for a, e in zip(alone, eager)]
            print(f"{dtype}: graphs == eager {result['graphs_equal_eager']}", flush=True)
            result["eager_throughput"] = throughput(engine, prompts, device)
    return result, alone


def check_quantized(device: str, prompts: list[list[int]], name: str) -> dict:
    """A quantized demo target in bf16 (`fp8`: quantized as it loads, `-q fp8`; `w4a16`:
    the shipped 4-bit copy; `w8a8`: a copy written now): what its linears multiply with
    (Fp8Linear on FP8 tensor cores, Int4Linear on tinygemm, Int8Int8Linear on _int_mm,
    "dense" where dequantized), greedy with the draft against the quantized target
    alone, tok/s (bf16's are the bfloat16 check's), and on a GPU its greedy output
    against the CPU's in bf16 (the share of each output before the first difference:
    bf16 kernels differ, so a small share is a wrong kernel, not rounding)."""
    if name == "fp8":
        quantized = {"quantization": "fp8"}
    elif name == "w4a16":
        quantized = {"target_dir": paths.demo_w4a16_target_dir(must_exist=True)}
    else:
        quantized = {"target_dir": w8a8_copy()}
    with engine_on(device, "bfloat16", **quantized) as engine:
        kernels = collections.Counter(
            type(m.quantized_matmul).__name__ if m.quantized_matmul is not None else "dense"
            for m in engine.decoder.target.model.modules() if getattr(m, "quantized_bits", 0))
        alone, spec = ids(greedy(engine, prompts[:8], 0)), ids(greedy(engine, prompts[:8], GAMMA))
        result = {"linears": dict(kernels),
                  "spec_equals_target": [a == s for a, s in zip(alone, spec)]}
        print(f"{name}: linears {result['linears']}, spec == target "
              f"{result['spec_equals_target']}", flush=True)
        result["throughput"] = throughput(engine, prompts, device)
    if device != "cpu":  # the device's kernels against the CPU's, on the same checkpoint
        with engine_on("cpu", "bfloat16", **quantized) as cpu:
            reference = ids(greedy(cpu, prompts[:8], 0))
        result["device_equals_cpu"] = [agreement(a, r) for a, r in zip(alone, reference)]
        print(f"{name}: device against CPU {result['device_equals_cpu']}", flush=True)
    return result


def w8a8_copy() -> Path:
    """The demo target quantized to W8A8 (compressed-tensors' format), in a temp folder."""
    sys.path.insert(0, str(REPO / "scripts"))
    from quantize_checkpoint import quantize

    out = Path(tempfile.mkdtemp(prefix="gpu-check-w8a8-")) / "demo-target-w8a8"
    quantize(paths.demo_pair()[0], out, "W8A8")
    return out


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


def check_kernel(device: str) -> dict:
    """The Triton kernels against the reference path on the device: a ragged batch of
    decode rows, chains and a token tree, grouped-query heads, a sliding window, in
    float32 and bfloat16 (the greatest absolute difference of each)."""
    from outrider.engine import attention
    from outrider.engine.attention import AttentionMetadata, SequenceSlice, kv_cache_shapes
    from outrider.engine.kernels import triton_paged

    gen = torch.Generator().manual_seed(0)
    block, num_blocks, heads, kv_heads, dim = 16, 64, 32, 8, 128
    mix = [(37, 1, None), (0, 1, None), (70, 5, None), (16, 4, [1, 3, 5, 9]), (300, 9, None)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for cached, new, tree in mix:
        blocks = -(-(cached + new) // block)
        seqs.append(SequenceSlice(cached, new, [order.pop() for _ in range(blocks)], tree))
    rows = sum(s.query_len for s in seqs)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        for window in (None, 64):
            make = lambda *shape, dtype=dtype: torch.randn(  # noqa: E731
                *shape, generator=gen).to(device, dtype)
            caches = [make(*shape) for shape in kv_cache_shapes(num_blocks, block, kv_heads, dim)]
            q, k, v = make(rows, heads, dim), make(rows, kv_heads, dim), make(rows, kv_heads, dim)
            meta = AttentionMetadata.build(seqs, block, torch.device(device))
            reference_meta = dataclasses.replace(meta, rows=None)  # the reference path
            want = attention.reference_attention(q.float(), k.float(), v.float(),
                                                 *[c.float() for c in caches], reference_meta,
                                                 window, dim ** -0.5)
            got = attention.paged_attention(q, k, v, *caches, meta, window, dim ** -0.5)
            key = f"{str(dtype).removeprefix('torch.')}_window{window or 0}"
            result[key] = round((got.float() - want).abs().max().item(), 5)
    print("kernel against reference, max abs difference:", result, flush=True)
    assert meta.rows is not None and triton_paged.triton_available()
    return result


def mid_pair(device: str, size: str) -> tuple[Path, Path]:
    """A random Llama of `size` (scripts/random_checkpoint.py) and a draft of its first
    layer, written on the device into a temporary folder (no hub there)."""
    import tempfile

    sys.path.insert(0, str(REPO / "scripts"))
    import random_checkpoint

    root = Path(tempfile.mkdtemp(prefix="outrider-mid-"))
    model = random_checkpoint.write("llama", root / "target", size, device, quieter_after=1)
    random_checkpoint.write_layer_draft(model, root / "draft", 1)
    del model
    return root / "target", root / "draft"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read and written a second by a device-to-device copy (the roofline's)."""
    size = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    synchronize(device)
    return 2 * size * 20 / (time.perf_counter() - start)


def timed_generate(decoder, prompts: list[list[int]], new_tokens: int, gamma: int,
                   device: str) -> tuple[float, list[Sequence]]:
    synchronize(device)
    start = time.perf_counter()
    seqs = decoder.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                            gamma=gamma)
    synchronize(device)
    return time.perf_counter() - start, seqs


def decode_step_s(decoder, prompts: list[list[int]], device: str) -> float:
    """A decode step's seconds: generating NEW_TOKENS + 1 tokens less generating one (the
    prefill), over NEW_TOKENS steps."""
    timed_generate(decoder, prompts, 2, 0, device)  # warm-up
    full, _ = timed_generate(decoder, prompts, NEW_TOKENS + 1, 0, device)
    prefill, _ = timed_generate(decoder, prompts, 1, 0, device)
    return (full - prefill) / NEW_TOKENS


def mid_runner(device: str, model_dir: Path, enforce_eager: bool,
               compile: bool = False) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=str(model_dir), device=device, dtype="bfloat16",
                                    kv_cache_mb=4096.0, enforce_eager=enforce_eager,
                                    compile=compile))


def decode_rows(runner: ModelRunner, prompts: list[list[int]], batches: tuple[int, ...],
                bandwidth: float, device: str, label: str) -> dict:
    """Per batch: a decode step's milliseconds, tok/s, and the roofline's share of it
    (the weights and the KV the step reads, over the copy bandwidth)."""
    from outrider.engine.spec_decode import SpeculativeDecoder

    mc = runner.model_config
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * runner.dtype.itemsize
    decoder, rows = SpeculativeDecoder(runner), {}
    for batch in batches:
        step = decode_step_s(decoder, prompts[:batch], device)
        read = (runner.weight_bytes - runner.bytes_saved_by_quantization
                + batch * (PROMPT_TOKENS + NEW_TOKENS // 2) * kv_per_token)
        rows[f"batch{batch}"] = {"step_ms": round(step * 1e3, 3),
                                 "tokens_per_s": round(batch / step),
                                 "roofline_share": round(read / bandwidth / step, 3)}
        print(f"mid {label} batch {batch}: {rows[f'batch{batch}']}", flush=True)
    return rows


def target_steps(runner: ModelRunner) -> list[int]:
    """Counts the runner's forwards from now on (in its first item)."""
    count, forward = [0], runner.forward

    def counted(*args, **kwargs):
        count[0] += 1
        return forward(*args, **kwargs)

    runner.forward = counted
    return count


def check_spec(runner: ModelRunner, draft_dir: Path, prompts: list[list[int]],
               device: str) -> dict:
    """The draft at γ 4 against speculation off, at batch 1 and 8: tok/s, and tokens a
    target forward (the prefill's included)."""
    from outrider.engine.drafter import Drafter
    from outrider.engine.spec_decode import SpeculativeDecoder

    off, spec = SpeculativeDecoder(runner), SpeculativeDecoder(
        runner, Drafter(mid_runner(device, draft_dir, False)))
    result = {}
    for batch in (1, 8):
        off_s, _ = timed_generate(off, prompts[:batch], NEW_TOKENS, 0, device)
        timed_generate(spec, prompts[:batch], 8, GAMMA, device)  # warm-up
        steps = target_steps(runner)
        spec_s, _ = timed_generate(spec, prompts[:batch], NEW_TOKENS, GAMMA, device)
        del runner.forward
        result[f"batch{batch}"] = {
            "off_tokens_per_s": round(batch * NEW_TOKENS / off_s),
            "gamma4_tokens_per_s": round(batch * NEW_TOKENS / spec_s),
            "speedup": round(off_s / spec_s, 2),
            "tokens_per_target_forward": round(NEW_TOKENS / steps[0], 2),
            "off_generate_s": round(off_s, 4)}
        print(f"mid spec batch {batch}: {result[f'batch{batch}']}", flush=True)
    result["outputs"] = ids(timed_generate(spec, prompts[:8], NEW_TOKENS, GAMMA, device)[1])
    return result


def check_mid(device: str, size: str) -> tuple[dict, tuple]:
    """The mid-size target's decode step against the roofline, from CUDA graphs and
    eager (with profiles of its steps); the first-layer draft's γ 4 against speculation
    off; greedy outputs of each against the graphs', with the target's margin where
    they part."""
    from outrider.engine.spec_decode import SpeculativeDecoder

    start = time.perf_counter()
    target_dir, draft_dir = mid_pair(device, size)
    bandwidth = copy_bandwidth(device)
    result = {"size": size, "write_s": round(time.perf_counter() - start, 1),
              "copy_bandwidth_gb_s": round(bandwidth / 1e9)}
    vocab = ModelConfig.from_dir(str(target_dir)).vocab_size
    prompts = torch.randint(3, vocab, (max(MID_BATCHES), PROMPT_TOKENS),
                            generator=torch.Generator().manual_seed(0)).tolist()
    runner = mid_runner(device, target_dir, False)
    result["graph_capture_s"] = round(runner.graph_capture_s, 1)
    result["weight_bytes"] = runner.weight_bytes
    result["graphs"] = decode_rows(runner, prompts, MID_BATCHES, bandwidth, device, "graphs")
    decoder = SpeculativeDecoder(runner)
    if device.startswith("cuda"):
        result["profiles"] = {f"graphs_batch{b}": profile_decode(decoder, prompts[:b])
                              for b in (1, 64)}
    alone = decoder.generate(prompts[:8], SamplingParams(max_tokens=NEW_TOKENS,
                                                         ignore_eos=True, logprobs=2), gamma=0)
    spec = check_spec(runner, draft_dir, prompts, device)
    result["spec"] = {k: v for k, v in spec.items() if k != "outputs"}
    result["spec_splits"] = splits(alone, spec["outputs"])
    del decoder, runner
    empty_cache(device)
    eager = mid_runner(device, target_dir, True)
    result["eager"] = decode_rows(eager, prompts, (1, 64), bandwidth, device, "eager")
    if device.startswith("cuda"):
        result["profiles"]["eager_batch64"] = profile_decode(SpeculativeDecoder(eager),
                                                             prompts[:64])
    eager_ids = ids(timed_generate(SpeculativeDecoder(eager), prompts[:8], NEW_TOKENS, 0,
                                   device)[1])
    result["eager_splits"] = splits(alone, eager_ids)
    print("mid splits from the graphs' greedy output: eager", result["eager_splits"],
          "spec", result["spec_splits"], flush=True)
    del eager
    empty_cache(device)
    return result, (target_dir, draft_dir)


def check_mid_compiled(device: str, target_dir: Path) -> dict:
    """The compiled forward inside the CUDA graphs: start-up and decode steps."""
    start = time.perf_counter()
    runner = mid_runner(device, target_dir, False, compile=True)
    result = {"start_s": round(time.perf_counter() - start, 1),
              "compile_s": round(runner.warm_up_s, 1),
              "graph_capture_s": round(runner.graph_capture_s, 1),
              "compiled": runner.step.is_compiled if hasattr(runner.step, "is_compiled")
              else False}
    vocab = runner.vocab_size
    prompts = torch.randint(3, vocab, (max(MID_BATCHES), PROMPT_TOKENS),
                            generator=torch.Generator().manual_seed(0)).tolist()
    result.update(decode_rows(runner, prompts, MID_BATCHES, copy_bandwidth(device), device,
                              "compiled graphs"))
    del runner
    empty_cache(device)
    return result


def empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def profile_decode(decoder, prompts: list[list[int]]) -> dict:
    """Where 16 decode steps of len(prompts) sequences go: wall time and GPU kernel time
    a step, the top GPU kernels, and the host's top Python functions (cProfile)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(max_tokens=17, ignore_eos=True)
    decoder.generate(prompts, params, gamma=0)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decoder.generate(prompts, params, gamma=0)
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_time_total > 0 and e.cpu_time_total == 0),
                     key=lambda e: -e.device_time_total)
    host = cProfile.Profile()
    start = time.perf_counter()
    host.runcall(decoder.generate, prompts, params, gamma=0)
    wall = time.perf_counter() - start
    stats = pstats.Stats(host)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # by own time
    return {"wall_ms_per_token_under_cprofile": round(wall / 17 * 1e3, 3),
            "kernel_ms_per_token": round(sum(e.device_time_total for e in kernels)
                                         / 17 / 1e3, 3),
            "kernels": [{"name": e.key[:70], "calls": e.count,
                         "ms": round(e.device_time_total / 1e3, 3)} for e in kernels[:12]],
            "host": [{"function": f"{Path(f).name}:{line} {name}", "calls": calls,
                      "own_ms": round(own * 1e3, 2), "cumulative_ms": round(cum * 1e3, 2)}
                     for (f, line, name), (_, calls, own, cum, _) in top]}


def check_transformers(device: str, target_dir: Path, draft_dir: Path,
                       dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> dict:
    """transformers' own generation at batch 1, greedy, against Outrider's (CUDA graphs)
    on the same prompt, in each dtype: its default (dynamic cache), a static cache (which
    its generate compiles on a GPU) and assisted generation with the same draft; tok/s
    of each one's second call; Outrider timed before and after them (two rounds); where
    an output leaves Outrider's, Outrider's margin between its two likeliest tokens."""
    from transformers import AutoModelForCausalLM

    from outrider.engine.spec_decode import SpeculativeDecoder

    prompt = torch.randint(3, ModelConfig.from_dir(str(target_dir)).vocab_size,
                           (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    result = {}
    for dtype in dtypes:
        runner = ModelRunner(RunnerConfig(model_dir=str(target_dir), device=device,
                                          dtype=dtype, kv_cache_mb=1024.0))
        decoder = SpeculativeDecoder(runner)
        ours = decoder.generate([prompt], params, gamma=0)[0]
        rounds = [timed_generate(decoder, [prompt], NEW_TOKENS, 0, device)[0]]
        model, assistant = (AutoModelForCausalLM.from_pretrained(
            d, dtype=getattr(torch, dtype)).to(device).eval() for d in (target_dir, draft_dir))
        rows = {}
        for name, extra in {"dynamic_cache": {},
                            "static_cache_compiled": {"cache_implementation": "static"},
                            "assisted": {"assistant_model": assistant}}.items():
            rows[name] = transformers_row(model, prompt, extra, device, ours)
        rounds.append(timed_generate(decoder, [prompt], NEW_TOKENS, 0, device)[0])
        for name, row in rows.items():
            row["outrider_speedup"] = [round(row["second_s"] / r, 2) for r in rounds]
            print(f"transformers {dtype} {name}: {row}", flush=True)
        rows["outrider_tokens_per_s"] = [round(NEW_TOKENS / r, 1) for r in rounds]
        result[dtype] = rows
        del decoder, runner, model, assistant
        empty_cache(device)
    return result


def transformers_row(model, prompt: list[int], extra: dict, device: str,
                     ours: Sequence) -> dict:
    ids_in = torch.tensor([prompt], device=device)
    row = {}
    for attempt in ("first", "second"):
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids_in, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, **extra)
        synchronize(device)
        row[f"{attempt}_s"] = round(time.perf_counter() - start, 3)
    row["tokens_per_s"] = round(NEW_TOKENS / row["second_s"], 1)
    theirs = out[0, len(prompt):].tolist()
    row["agrees_with_outrider"] = round(agreement(theirs, ours.output_ids), 3)
    row["split"] = splits([ours], [theirs])
    return row


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
    parser.add_argument("--mid", metavar="SIZE", choices=("1b", "140m", "demo"),
                        help="first: a random Llama of this size (scripts/random_checkpoint"
                             ".py) against the roofline and transformers' generation")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no check after this many seconds (a device's lease is "
                             "short: the JSON is written after each check)")
    parser.add_argument("--only", metavar="CHECKS",
                        help="run only these checks (comma-separated: mid, mid_compiled, "
                             "float32, served_DTYPE, transformers, bfloat16, fp8, w4a16, w8a8, "
                             "kv_from_memory, compiled_float32)")
    args = parser.parse_args()
    use_cpu_kernels(False)  # the CPU side is the reference path (no C++ build here)
    report = {"provenance": provenance(args.device)}
    print(report, flush=True)
    deadline = time.monotonic() + args.budget_s

    def due(name: str) -> bool:
        if args.only and name not in args.only.split(","):
            return False
        if time.monotonic() < deadline:
            return True
        report.setdefault("skipped", []).append(name)
        print(f"skipped {name}: past --budget-s", flush=True)
        return False

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))

    if args.device.startswith("cuda"):
        try:
            report["kernel"] = check_kernel(args.device)
        except Exception as exc:  # noqa: BLE001 (the rest of the run measures without it)
            report["kernel"] = {"failed": f"{type(exc).__name__}: {exc}"[:2000]}
            print("kernel check failed, the reference path from here:", exc, flush=True)
            os.environ[triton_paged.DISABLE_ENV] = "1"
            triton_paged.triton_available.cache_clear()
        save()
    mid = None
    if args.mid and due("mid"):
        report["mid"], mid = check_mid(args.device, args.mid)
        save()
    elif args.mid and (due("transformers") or due("mid_compiled")):
        mid = mid_pair(args.device, args.mid)
    if mid is not None and args.compile and due("mid_compiled"):
        report["mid_compiled"] = check_mid_compiled(args.device, mid[0])
        save()
    with engine_on("cpu", "float32") as cpu:
        prompts = code_prompts(cpu, max(BATCHES))
        if args.profile:
            for dtype in args.profile.split(","):
                profile(args.device, dtype, prompts)
            return
        cpu_ref = ids(greedy(cpu, prompts[:8], 0)) if due("float32") else None
    if cpu_ref is not None:
        report["float32"], eager = check_dtype(args.device, "float32", prompts, cpu_ref)
        save()
    for dtype in (args.served or "").split(",") if args.served else ():
        if due(f"served_{dtype}"):
            report[f"served_{dtype}"] = check_served(args.device, dtype, prompts,
                                                     Path(args.out))
            save()
    if mid is not None and due("transformers"):
        report["transformers"] = check_transformers(args.device, *mid[:2])
        save()
    if due("bfloat16"):
        report["bfloat16"], _ = check_dtype(args.device, "bfloat16", prompts, None)
        save()
    for name in ("fp8", "w4a16", "w8a8"):
        if due(name):
            report[name] = check_quantized(args.device, prompts, name)
            save()
    if args.device.startswith("cuda") and due("kv_from_memory"):
        report["kv_from_memory"] = check_kv_from_memory(args.device)
    if args.compile and due("compiled_float32"):
        report["compiled_float32"] = check_compiled(args.device, prompts, eager)
    save()


if __name__ == "__main__":
    main()
