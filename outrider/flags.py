"""Flags several `outrider` subcommands share: the roles (router, target-worker,
draft-worker) add them from their own modules, so they live here, not in outrider.cli."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from outrider.core.sequence import NGRAM_MAX, NGRAM_MIN, NGRAM_SIZES, ProposerKind

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_server_args(p: argparse.ArgumentParser, *, host: str, port: int, device: str,
                          dtype: str, threads: int, threads_help: str) -> None:
    """Where a replica listens and how it runs its model (the role's defaults)."""
    p.add_argument("--host", default=host, help="the interface it listens on")
    p.add_argument("--port", type=int, default=port, help="0 picks a free port")
    add_device_args(p, device, dtype)
    add_kv_cache_args(p)
    p.add_argument("--threads", type=int, default=threads, help=threads_help)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share the KV of prompts' common prefixes (default: on)")
    add_compile_arg(p)


# vLLM's --quantization names -> the quant_method of the checkpoints each reads (its
# Marlin kernels' names read the same checkpoints as their methods)
QUANTIZATION_METHODS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq",
                        "gptq_marlin": "gptq", "compressed-tensors": "compressed-tensors",
                        "fp8": "fp8"}
QUANTIZED_ON_LOAD = ("fp8",)  # an unquantized checkpoint quantized as it loads (quant/scheme.py)


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quantization", choices=sorted(QUANTIZATION_METHODS), default=None,
                   help="vLLM's: the method the target's checkpoint is quantized with, "
                        "checked against its config.json, which decides how it loads; or, "
                        "for an unquantized checkpoint, fp8: its linears quantized as they "
                        "load (e4m3, a scale a tensor; computed in FP8 on GPUs that have "
                        "it, dequantized elsewhere) (default: None)")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """Token trees (outrider/engine/tree.py): SGLang's names beside ours."""
    p.add_argument("--tree-topk", "--speculative-eagle-topk", type=int, default=1,
                   help="draft a token tree: each expanded node's top-k children, the k best "
                        "nodes grown per level, γ levels deep (1: a chain, the default; "
                        "a draft model or a head (EAGLE, Medusa) in the target's process)")
    p.add_argument("--tree-tokens", "--speculative-num-draft-tokens", type=int, default=0,
                   help="nodes of a tree the target verifies per round, the best by "
                        "cumulative log-probability (0: every node drafted; below 64)")


def tree_shape(args: argparse.Namespace):
    """--tree-topk and --tree-tokens as a TreeShape; a bad pair is a usage error."""
    from outrider.engine.tree import TreeShape

    try:
        return TreeShape(args.tree_topk, args.tree_tokens)
    except ValueError as exc:
        raise ValueError(f"--tree-topk/--tree-tokens: {exc}") from None


def add_compile_arg(p: argparse.ArgumentParser, default: bool = False) -> None:
    """--compile / --no-compile (RunnerConfig.compile; the default is what measured
    faster on the demo pair, BENCHMARKS.md)."""
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default,
                   help="run the model's forward as a compiled graph (torch.compile, "
                        "compiled at start and cached on disk; eager if compiling fails; "
                        f"default: {'on' if default else 'off'})")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step eagerly (vLLM's flag); by default steps "
                        "of short queries replay CUDA graphs captured at start")


def add_device_args(p: argparse.ArgumentParser, device: str = "auto",
                    dtype: str = "auto") -> None:
    p.add_argument("--device", type=device_arg, default=device,
                   help="auto (cuda where torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default=dtype,
                   help="auto: the checkpoint's where the device computes it natively "
                        "(bf16 on GPUs and on CPUs with AVX512-BF16 or AMX), else float32")


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    """The KV cache's size: given, or sized from memory (engine/memory.py)."""
    p.add_argument("--kv-cache-mb", type=float, default=None,
                   help="KV cache per rank, in MiB (default: sized from memory by "
                        "--gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=unit_share, default=None,
                   help="with no --kv-cache-mb: on a GPU, the share of its memory this "
                        "process may take, weights included (default 0.9, as vLLM); on a "
                        "CPU, the share of the machine's memory one rank's KV cache takes "
                        "(default 0.1: replicas share the machine), at most what a full "
                        "batch of full-length sequences uses")


def unit_share(value: str) -> float:
    """A share in (0, 1], checked when parsed."""
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"a share in (0, 1] (got {value!r})")
    return share


def add_max_model_len_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence served, prompt and output (default: the "
                        "model's context, at most 8192); checked at start against the "
                        "model's context and the KV cache")


def device_arg(value: str) -> str:
    """--device, checked when parsed; "auto" is resolved where a model loads."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"choose from auto, cpu, cuda, cuda:N (got {value!r})")


def resolve_device(device: str) -> str:
    """--device auto: CUDA where torch sees a GPU, as vLLM picks its platform."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_cpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", help="run on these CPU cores only, e.g. 0-2,5 (Linux; default: "
                                   "any)")


def add_metrics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free "
                        "port; default: off). Traces go to $OTEL_EXPORTER_OTLP_ENDPOINT")


PROPOSERS = tuple(kind.value for kind in ProposerKind)


def add_proposer_arg(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """--proposer: what proposes draft tokens for requests that name none (docs/DESIGN.md
    §2.8)."""
    p.add_argument("--proposer", choices=PROPOSERS, default=default,
                   help="what proposes draft tokens: auto (per round: a lookup, the draft "
                        "model, or the lookup continued by the model; with no draft model, "
                        "the lookups alone), model (the draft model), ngram (prompt lookup "
                        "over the request's own tokens), suffix (suffix match over the "
                        "request and recently served sequences) or lookahead (the target's "
                        "own guesses from its verification rows); default: " + default)
    add_ngram_arg(p)


def add_ngram_arg(p: argparse.ArgumentParser) -> None:
    """--ngram-sizes: the n-gram lookup's (outrider/engine/lookup.py)."""
    p.add_argument("--ngram-sizes", type=ngram_sizes, default=None,
                   metavar="MIN,MAX",
                   help="the n-gram lookup's match: the longest n-gram of MIN to MAX tokens "
                        "ending the request that occurred in it before (vLLM's "
                        f"prompt_lookup_min/max; generate: with --local; default "
                        f"{NGRAM_MIN},{NGRAM_MAX})")


def ngram_sizes_of_args(args: argparse.Namespace) -> tuple[int, int]:
    """--ngram-sizes as given (or by --speculative-config), else the default."""
    return args.ngram_sizes or NGRAM_SIZES


def ngram_sizes(text: str) -> tuple[int, int]:
    """--ngram-sizes MIN,MAX as (MIN, MAX): 1 <= MIN <= MAX."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN,MAX (two integers)") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= MIN <= MAX")
    return low, high


def add_self_draft_arg(p: argparse.ArgumentParser) -> None:
    """--self-draft-layers: self-speculation (outrider/engine/layer_skip.py)."""
    p.add_argument("--self-draft-layers", metavar="auto|I,J,...", default=None,
                   help="self-speculation with no draft model: the target drafts through "
                        "these of its layers (layer skip), in its own process; auto: the "
                        "subset measured best for this checkpoint (searched once, kept in "
                        "~/.cache/outrider/layer_skip) (default: None, off)")


def check_self_draft(layers: str | None, flags: str, *drafts: object) -> None:
    """--self-draft-layers is the draft: refused beside another one (`drafts`, given by
    `flags`)."""
    if layers and any(drafts):
        raise ValueError(f"--self-draft-layers drafts with the target's own layers: give it "
                         f"without {flags}")


def served_as(entry: str) -> tuple[str, str]:
    """An --also-serve entry as (model id, checkpoint dir): NAME=DIR, or DIR served under
    its dir's name. A NAME holds no "/": write a dir whose name holds "=" as ./DIR."""
    name, sep, model_dir = entry.partition("=")
    if sep and "/" not in name:
        if not name or not model_dir:
            raise ValueError(f"--also-serve {entry!r}: give NAME=DIR or DIR")
        return name, model_dir
    return served_model_id(entry), entry


def served_model_id(model_dir: str) -> str:
    """A checkpoint's model id where none is given: its dir's name, the path resolved
    (what `/v1/models` lists; replicas are matched by core.hf_config.checkpoint_name)."""
    return Path(model_dir).resolve().name
