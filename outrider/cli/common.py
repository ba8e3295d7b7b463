"""What several subcommands share: the model flags and their resolution, usage errors,
and waiting for a stop signal."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path

from outrider import paths
from outrider.core.hf_config import head_kind
from outrider.core.sequence import NGRAM_MAX, NGRAM_MIN
from outrider.flags import (
    QUANTIZATION_METHODS,
    QUANTIZED_ON_LOAD,
    add_compile_arg,
    add_device_args,
    add_kv_cache_args,
    add_max_model_len_arg,
    add_quantization_arg,
    add_tree_args,
    resolve_device,
)


class UsageError(ValueError):
    pass


def add_model_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """The model flags; vLLM's names (`--model`, `--tensor-parallel-size`) beside ours."""
    if model_positional:  # `outrider serve MODEL`, as `vllm serve MODEL`
        p.add_argument("model_dir", nargs="?", metavar="MODEL",
                       help="target checkpoint dir (the same as --target)")
    p.add_argument("--target", "--model", help="target checkpoint dir (default: the shipped "
                                               "demo target)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the demo draft when the "
                                   "target is the demo target, else none)")
    p.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per round (0: no speculation; default 4)")
    p.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                   help="vLLM's: {\"model\": DIR, \"num_speculative_tokens\": N, "
                        "\"method\": \"draft_model\"|\"ngram\"|\"suffix\"|\"eagle3\"|...} "
                        "for --draft, --gamma and --proposer; {\"method\": \"layer_skip\", "
                        "\"draft_layers\": \"auto\"|[I, J, ...]} for --self-draft-layers")
    p.add_argument("--tp", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel degree of the target")
    add_quantization_arg(p)
    add_device_args(p)
    add_kv_cache_args(p)
    add_max_model_len_arg(p)
    add_compile_arg(p)
    add_tree_args(p)


def add_client_tls_args(p: argparse.ArgumentParser) -> None:
    """How a client reaches a router that uses TLS, or mTLS."""
    p.add_argument("--tls-ca", help="CA certificate (PEM) when the router uses TLS")
    p.add_argument("--tls-cert", help="client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", help="private key (PEM) of --tls-cert")


def client_tls(args):
    """The client's Tls from add_client_tls_args' flags (None: plaintext)."""
    from outrider.client import Tls

    return Tls(args.tls_ca, args.tls_cert, args.tls_key) \
        if args.tls_ca or args.tls_cert else None


def model_dirs(args) -> tuple[Path, str | None]:
    """(target, draft): the shipped demo pair unless told otherwise. Fills in the default
    --gamma, which `generate` leaves unset so that it can tell a remote router "auto", and
    resolves --device auto."""
    _apply_speculative_config(args)
    given = {d for d in (args.target, getattr(args, "model_dir", None)) if d}
    if len(given) > 1:
        raise UsageError(f"two models given ({' and '.join(sorted(given))}): pass MODEL or "
                         "--target/--model, once")
    target = Path(given.pop()) if given else paths.demo_target_dir(must_exist=True)
    draft = args.draft
    if draft is None and not getattr(args, "self_draft_layers", None) \
            and target.resolve() == paths.demo_target_dir().resolve():
        draft = str(paths.demo_draft_dir(must_exist=True))
    if not (target / "config.json").is_file():
        raise UsageError(f"no model at {target} (pass MODEL or --target DIR)")
    _check_quantization(getattr(args, "quantization", None), target)
    draft = draft or None
    if args.gamma is None:
        from outrider.target_worker.main import TargetWorkerConfig

        args.gamma = TargetWorkerConfig.gamma
    if args.gamma < 0:
        raise UsageError(f"--gamma must be >= 0, got {args.gamma}")
    args.device = resolve_device(args.device)
    return target, draft


def _check_quantization(method: str | None, target: Path) -> None:
    """--quantization as vLLM takes it: the checkpoint's own method, named again (what the
    checkpoint says decides), or a method that quantizes an unquantized checkpoint as it
    loads. Anything else is a usage error saying so."""
    if method is None:
        return
    config = json.loads((target / "config.json").read_text())
    stored = (config.get("quantization_config") or {}).get("quant_method")
    if stored is None and method not in QUANTIZED_ON_LOAD:
        raise UsageError(f"--quantization {method}: {target} is not quantized, and only "
                         f"{', '.join(QUANTIZED_ON_LOAD)} quantizes one as it loads (or "
                         f"write a quantized copy with scripts/quantize_checkpoint.py)")
    if stored is not None and QUANTIZATION_METHODS[method] != stored:
        raise UsageError(f"--quantization {method} does not match {target}'s quantization_config "
                         f"(quant_method {stored!r})")


SPECULATIVE_METHODS = {"draft_model": "model", "ngram": "ngram", "suffix": "suffix",
                       "eagle3": "model", "eagle": "model", "medusa": "model",
                       "layer_skip": "model", "lookahead": "lookahead"}
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")  # vLLM's, for method "ngram"
# vLLM's, for a draft model or head, taken as far as _check_vllm_values says
DRAFT_MODEL_KEYS = ("draft_tensor_parallel_size", "use_heterogeneous_vocab")
# method -> the head kind it names
HEAD_METHODS = {"eagle3": "eagle3", "eagle": "eagle1", "medusa": "medusa"}


def speculative_config(text: str) -> dict:
    """--speculative-config, checked when parsed: what Outrider has of vLLM's keys."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    method = config.get("method", "draft_model")
    if method not in SPECULATIVE_METHODS:
        raise argparse.ArgumentTypeError(
            f"method {method!r}: choose from {', '.join(SPECULATIVE_METHODS)}")
    taken = ({"num_speculative_tokens", "method", "draft_layers"} if method == "layer_skip"
             else {"num_speculative_tokens", "method", *NGRAM_KEYS} if method == "ngram"
             else {"model", "num_speculative_tokens", "method", *DRAFT_MODEL_KEYS})
    unknown = sorted(set(config) - taken)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: not taken (with method {method!r} Outrider takes "
            f"{', '.join(sorted(taken))})")
    _check_vllm_values(config)
    layers = config.get("draft_layers", "auto")
    if layers != "auto" and not (isinstance(layers, list) and layers
                                 and all(isinstance(i, int) for i in layers)):
        raise argparse.ArgumentTypeError(f"draft_layers {layers!r}: \"auto\" or a list of the "
                                         "target's layer numbers")
    if method in HEAD_METHODS and not config.get("model"):
        raise argparse.ArgumentTypeError(f"method {method!r} needs a model: the head's "
                                         f"checkpoint dir")
    if method in HEAD_METHODS and head_kind(config["model"]) != HEAD_METHODS[method]:
        raise argparse.ArgumentTypeError(
            f"method {method!r}: {config['model']} holds no {HEAD_METHODS[method]} head "
            f"(its config.json's architectures)")
    return config


def _check_vllm_values(config: dict) -> None:
    """vLLM's keys whose values Outrider takes only in part: the n-gram sizes; a draft's
    tensor-parallel size (draft replicas run whole: 1); heterogeneous vocabularies (a
    draft of another tokenizer is bridged whenever the tokenizers differ, §2.9)."""
    sizes = [config.get(key) for key in NGRAM_KEYS]
    if any(size is not None and (type(size) is not int or size < 1) for size in sizes) \
            or (None not in sizes and sizes[0] > sizes[1]):
        raise argparse.ArgumentTypeError(f"prompt_lookup_min {sizes[0]}, prompt_lookup_max "
                                         f"{sizes[1]}: integers, 1 <= min <= max")
    if config.get("draft_tensor_parallel_size") not in (None, 1):
        raise argparse.ArgumentTypeError(
            f"draft_tensor_parallel_size {config['draft_tensor_parallel_size']}: drafts run "
            f"whole on their replicas (1; add replicas with --draft-replicas)")
    if not isinstance(config.get("use_heterogeneous_vocab", False), bool):
        raise argparse.ArgumentTypeError("use_heterogeneous_vocab: true or false (a draft of "
                                         "another tokenizer is bridged either way)")


def _apply_speculative_config(args) -> None:
    """--speculative-config as the flags it stands for; given with them, a usage error."""
    config = getattr(args, "speculative_config", None)
    if not config:
        return
    if args.draft is not None or args.gamma is not None \
            or getattr(args, "self_draft_layers", None):
        raise UsageError("--speculative-config says what --draft, --gamma and "
                         "--self-draft-layers say: give one")
    method = config.get("method", "draft_model")
    proposer = SPECULATIVE_METHODS[method]
    # a lookup method names no model: none runs ("" keeps the demo draft away); layer
    # skip's draft is the target itself
    args.draft = config.get("model", "" if proposer != "model" or method == "layer_skip"
                            else None)
    if method == "layer_skip":
        layers = config.get("draft_layers", "auto")
        args.self_draft_layers = layers if layers == "auto" else ",".join(map(str, layers))
    args.gamma = config.get("num_speculative_tokens")
    if any(key in config for key in NGRAM_KEYS):
        if getattr(args, "ngram_sizes", None) is not None:
            raise UsageError("--speculative-config's prompt_lookup_min/max say what "
                             "--ngram-sizes says: give one")
        args.ngram_sizes = ngram_sizes_of(config)
    if hasattr(args, "proposer"):
        args.proposer = proposer


def ngram_sizes_of(config: dict) -> tuple[int, int]:
    """vLLM's prompt_lookup_min/max as --ngram-sizes: one given alone bounds ours (2-5) on
    its side, the other moved to meet it where they cross."""
    low, high = (config.get(key) for key in NGRAM_KEYS)
    if low is None:
        return min(NGRAM_MIN, high), high
    return low, high if high is not None else max(NGRAM_MAX, low)


def stop_on_signals() -> threading.Event:
    """An event SIGTERM or Ctrl-C sets: a foreground command waits on it and then shuts
    down in order (SIGTERM would otherwise end the process without any cleanup)."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping
