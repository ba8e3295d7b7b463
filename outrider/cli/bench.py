"""`outrider bench`: the serving benchmark, or with a flag one of the others
(outrider.bench.versus, prefix, adapt, step, proposers, structured)."""

from __future__ import annotations

import argparse


def bench_flags(bench: argparse.ArgumentParser) -> None:
    from outrider.bench import adapt, prefix, proposers, serving, step, structured, versus

    serving.add_arguments(bench)
    bench.add_argument("--vllm", help="instead: served Outrider vs its in-process engine vs "
                                      "vLLM with vLLM's load client (outrider.bench.versus); "
                                      "a vLLM venv, or the command that runs vLLM's CLI")
    versus.add_arguments(bench, standalone=False)
    bench.add_argument("--shared-prefix", action="store_true",
                       help="instead: multi-turn conversations over one system prompt, "
                            "prefix caching on and off, cache-aware and round-robin routing "
                            "(with --vllm: vLLM's prefix caching too; outrider.bench.prefix)")
    prefix.add_arguments(bench, standalone=False)
    bench.add_argument("--adapt", action="store_true",
                       help="instead: drafts learning while they serve, acceptance and "
                            "batch-1 speed against tokens served (outrider.bench.adapt)")
    adapt.add_arguments(bench, standalone=False)
    bench.add_argument("--step", action="store_true",
                       help="instead: the target's forward at batch 1/8/32 (decode, "
                            "verification) and a prefill chunk, eager and compiled, per "
                            "dtype, broken down beside the machine's limit "
                            "(outrider.bench.step)")
    step.add_arguments(bench, standalone=False)
    bench.add_argument("--proposers", action="store_true",
                       help="instead (with --vllm): what proposes draft tokens (auto, "
                            "model, ngram, suffix) on copy-heavy and plain code prompts, "
                            "against vLLM's n-gram and draft-model speculation "
                            "(outrider.bench.proposers)")
    proposers.add_arguments(bench, standalone=False)
    bench.add_argument("--structured", action="store_true",
                       help="instead: structured outputs (JSON schema, regex, choice, "
                            "grammar) served: validity, acceptance and throughput constrained "
                            "against unconstrained; with --vllm beside vLLM's draft model "
                            "(outrider.bench.structured)")
    structured.add_arguments(bench, standalone=False)


def cmd_bench(args) -> int:
    from outrider.bench import serving

    benchmark = _chosen_benchmark(args)
    # --out's default is the serving benchmark's file: the others write their own unless told
    if benchmark is not serving and args.out == serving.DEFAULT_OUT:
        args.out = benchmark.DEFAULT_OUT
    return benchmark.run(args)


def _chosen_benchmark(args):
    """The module of the first benchmark flag given, else the serving benchmark's
    (--shared-prefix, --proposers and --structured read --vllm themselves: vLLM beside
    Outrider)."""
    from outrider.bench import adapt, prefix, proposers, serving, step, structured, versus

    chosen = ((args.step, step), (args.adapt, adapt), (args.shared_prefix, prefix),
              (args.proposers, proposers), (args.structured, structured), (args.vllm, versus))
    return next((module for wanted, module in chosen if wanted), serving)
