"""The servers the benchmarks against vLLM start and the load client that drives them:
`outrider serve` and `vllm serve` on the demo pair (each started as a user starts it,
stopped with its process group), `vllm bench serve` over the OpenAI API (one client for
every server), the cells it gives merged over rounds, and the flags those benchmarks
share (outrider.bench.versus, proposers and structured). vLLM is only ever a peer here:
nothing of Outrider imports it."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from outrider import paths
from outrider.bench.tables import sampling_pairs
from outrider.launch import free_port

SERVED_NAME = "demo-target"
DEFAULT_SAMPLING = "temperature=0"


# -- the load client -----------------------------------------------------------------------
def vllm_command(vllm: str) -> list[str]:
    """A venv's bin/vllm, or the command given."""
    venv_cli = Path(vllm) / "bin" / "vllm"
    return [str(venv_cli)] if venv_cli.is_file() else shlex.split(vllm)


def sampling_flags(spec: str) -> list[str]:
    """`temperature=0.8,top_p=0.9` -> vllm bench serve's flags (--temperature 0.8 ...)."""
    return [item for name, value in sampling_pairs(spec).items()
            for item in (f"--{name.replace('_', '-')}", value)]


def bench_serve(vllm: list[str], base_url: str, tokenizer_dir: str, prompts_file: Path,
                concurrency: int, num_prompts: int, max_tokens: int, out_dir: Path,
                label: str, extra_body: dict | None = None,
                sampling: str = DEFAULT_SAMPLING) -> dict:
    """One `vllm bench serve` run; its saved result (output_throughput, median_ttft_ms,
    ...)."""
    name = f"{label}-c{concurrency}.json"
    command = [*vllm, "bench", "serve", "--backend", "openai", "--base-url", base_url,
               "--endpoint", "/v1/completions", "--model", SERVED_NAME,
               "--tokenizer", tokenizer_dir, "--dataset-name", "custom",
               "--dataset-path", str(prompts_file), "--skip-chat-template",
               "--custom-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(concurrency), "--ignore-eos", *sampling_flags(sampling),
               "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
               "--result-filename", name]
    if extra_body:
        command += ["--extra-body", json.dumps(extra_body)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    result = out_dir / name
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed ({label}, c={concurrency}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    data = json.loads(result.read_text())
    if data.get("failed"):
        raise RuntimeError(f"vllm bench serve: {data['failed']} failed requests ({label}, "
                           f"c={concurrency}): {data.get('errors', [])[:3]}")
    return data


def cell(data: dict) -> dict:
    return {"tokens_per_s": data["output_throughput"], "ttft_ms_p50": data["median_ttft_ms"],
            "ttft_ms_p99": data["p99_ttft_ms"], "itl_ms_p50": data["median_itl_ms"],
            "tpot_ms_p50": data["median_tpot_ms"], "requests": data["completed"]}


def num_requests(concurrency: int, per_stream: int) -> int:
    return max(16, concurrency * per_stream)


def merge_rounds(rounds: list[dict[str, dict[int, dict]]]) -> dict[str, dict[int, dict]]:
    """Each cell's mean over rounds, with every round's value kept."""
    merged: dict[str, dict[int, dict]] = {}
    for system in rounds[0]:
        merged[system] = {}
        for c in rounds[0][system]:
            cells = [r[system][c] for r in rounds]
            merged[system][c] = {k: statistics.fmean(x[k] for x in cells) for k in cells[0]}
            merged[system][c]["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in cells]
    return merged


def speed_ratio(a: dict, b: dict) -> float | None:
    """Cell a's tokens/s over cell b's (None when b served nothing)."""
    return a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None


# -- servers -------------------------------------------------------------------------------
@contextmanager
def outrider_server(args, extra: tuple[str, ...] = (),
                    draft: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """`outrider serve` on the demo pair (as a user starts it; `draft`: another draft or
    head, "" none), with `extra` flags; yields its HTTP base URL and its target replicas'
    metrics URLs (as serve prints them)."""
    port = free_port()
    command = [sys.executable, "-m", "outrider.cli", "serve", "--target", args.target,
               "--draft", args.draft if draft is None else draft, "--gamma", str(args.gamma),
               "--grpc-port", "0", "--host", "127.0.0.1", "--http-port", str(port),
               "--served-model-name", SERVED_NAME,
               "--dtype", args.dtype, *extra]
    with _server(command, f"http://127.0.0.1:{port}", os.environ) as log:
        yield f"http://127.0.0.1:{port}", _printed_metrics(log, "target")


def _printed_metrics(log, role: str, timeout_s: float = 10) -> list[str]:
    """The metrics URLs `outrider serve` printed for `role`'s processes (it prints them
    just after it answers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log.seek(0)
        found = re.findall(rf"outrider serve: {role}\S* metrics at (http://\S+)/metrics",
                           log.read())
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@contextmanager
def base_url(server) -> Iterator[str]:
    """A server's base URL alone (outrider_server and vllm_server also yield the metrics
    URLs of Outrider's replicas)."""
    with server as (url, _):
        yield url


def vllm_system(with_draft: bool, gamma: int) -> str:
    """The vllm_server system of vLLM with the draft model or without it."""
    return f"vllm-draft{gamma}" if with_draft else "vllm"


VLLM_NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@contextmanager
def vllm_server(args, system: str, extra: tuple[str, ...] = ()) -> Iterator[str]:
    port = free_port()
    command = [*vllm_command(args.vllm), "serve", args.target, "--served-model-name",
               SERVED_NAME, "--dtype", args.dtype, "--max-model-len", "1024", "--port",
               str(port), *extra]
    if system == "vllm-ngram":
        command += ["--speculative-config", json.dumps(
            {**VLLM_NGRAM, "num_speculative_tokens": args.gamma})]
    elif system != "vllm":  # vllm-draftN, vllm-eagle3
        head = system == "vllm-eagle3"
        command += ["--speculative-config", json.dumps(
            {"model": args.head if head else args.draft,
             "method": "eagle3" if head else "draft_model",
             "num_speculative_tokens": args.gamma})]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    with _server(command, f"http://127.0.0.1:{port}", env):
        yield f"http://127.0.0.1:{port}", []


@contextmanager
def _server(command: list[str], url: str, env, timeout_s: float = 600) -> Iterator:
    """The server started and answering at `url`; yields its output (a file) so far."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            _wait_ready(proc, url, timeout_s, log)
            yield log
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after a minute; a server that has
    exited already (it failed to start) leaves its own error to be seen."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{proc.args[0]} exited while starting:\n{log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


# -- command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks against vLLM (outrider.bench.versus's, which
    proposers and structured take too)."""
    parser.add_argument("--gamma", type=int, default=4,
                        help="γ of FIXED, the engine and vLLM's draft (and the server's default)")
    parser.add_argument("--head", default=str(paths.demo_head_dir()),
                        help="the draft head (EAGLE-3) of outrider-head and vllm-eagle3")
    parser.add_argument("--tree-topk", type=int, default=3, help="outrider-head-tree's")
    parser.add_argument("--tree-tokens", type=int, default=16, help="outrider-head-tree's")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every level, the systems' order reversed each time")
    parser.add_argument("--requests-per-stream", type=int, default=4,
                        help="requests per concurrency level: this many per stream (>= 16)")
    parser.add_argument("--systems", default=None,
                        help="comma list (default: outrider-auto,outrider-fixedG,engine-gG,"
                             "engine-g0,vllm-draftG,vllm); --hf adds transformers at batch 1")
    parser.add_argument("--sampling", default=DEFAULT_SAMPLING,
                        help="the client's sampling flags as NAME=VALUE pairs, e.g. "
                             "temperature=0.8,top_p=0.9,repetition_penalty=1.1,logprobs=2 "
                             "(vllm bench serve's names; default: greedy). The in-process "
                             "engine rows are greedy whatever this says")
    parser.add_argument("--temperature", type=float, default=None,
                        help="the client's temperature (production traffic is sampled: "
                             "BENCHMARKS §1 is at 0.7); added to --sampling")
    parser.add_argument("--top-p", type=float, default=None,
                        help="the client's top_p; added to --sampling")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="(--vllm) of every system's models; auto: each system's own "
                             "default (both take a bf16 checkpoint's dtype on a CPU with "
                             "bf16 instructions)")
    parser.add_argument("--hf", action="store_true",
                        help="transformers (assisted generation) at batch 1 on the same prompts")
