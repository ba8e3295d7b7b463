"""Batch-1 greedy decoding side by side with Hugging Face transformers, on this machine,
the same model pair, the same prompts and the same torch thread budget.

    python -m outrider.bench.hf_peer [--address HOST:PORT] [--prompts 4] [--max-tokens 96]
        [--gamma 4] [--threads 2] [--no-deployment]

Runs (prompt by prompt, every runner in turn, the order rotating):
  * transformers `generate` with the target only;
  * transformers assisted generation (`assistant_model=` the draft) with its defaults
    (20 assistant tokens, dynamic confidence threshold 0.4), and with γ assistant tokens,
    constant, no threshold (the same γ as Outrider's fixed mode);
  * Outrider's in-process engine (SpeculativeDecoder: target only, and γ draft tokens);
  * a live Outrider deployment at concurrency 1 through the router's public API
    (speculation off, fixed γ, auto) — the one at --address, or one started here.
Every runner must return the target's own greedy tokens: the report says, per runner,
on how many prompts its output equals transformers' target-only output.
Writes results/serving_peer.json; `outrider bench --peer` embeds the same report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from tqdm import tqdm

from outrider import paths
from outrider.bench import common
from outrider.bench.prompts import workload_prompts
from outrider.core.tokenizer import Tokenizer
from outrider.v1 import generate_pb2_grpc

Runner = Callable[[list[int], int], list[int]]  # (prompt ids, max tokens) -> output ids


# -- runners -------------------------------------------------------------------------------
def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_runner(model, assistant=None, num_assistant_tokens: int | None = None,
              tokenizers: dict | None = None) -> Runner:
    """transformers greedy `generate`, exactly max_tokens new tokens (EOS suppressed as
    Outrider's ignore_eos does). With num_assistant_tokens: a constant γ and no
    confidence threshold; without: the assistant's defaults. `tokenizers` (tokenizer,
    assistant_tokenizer): an assistant of another vocabulary, transformers' universal
    assisted generation."""
    def run(prompt: list[int], max_tokens: int) -> list[int]:
        if assistant is not None and num_assistant_tokens is not None:
            config = assistant.generation_config
            config.num_assistant_tokens = num_assistant_tokens
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=model.config.pad_token_id or 0,
                                 assistant_model=assistant, **(tokenizers or {}))
        return out[0, len(prompt):].tolist()

    return run


def engine_runner(decoder, gamma: int) -> Runner:
    """Outrider's single-process speculative loop (γ = 0: the target alone)."""
    from outrider.core.sampling import SamplingParams

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return decoder.generate([prompt], params, gamma)[0].output_ids

    return run


def deployment_runner(stub, mode: str, tag: str, metadata=()) -> Runner:
    """One greedy request through the router's public API (GenerateStream)."""
    def run(prompt: list[int], max_tokens: int) -> list[int]:
        request = common.build_request(prompt, "greedy", common.Mode.parse(mode), max_tokens,
                                       seed=0, tag=tag)
        return common.stream_request(stub, request, metadata).token_ids

    return run


def deployment_runners(stub, gamma: int, workload: str, metadata=()) -> dict[str, Runner]:
    """Off, fixed γ and auto through the router; the workload's tag keeps AUTO's
    acceptance prior per workload (as in outrider.bench.serving)."""
    tag = common.tag_for(workload, "greedy")
    return {f"deployment_{mode}": deployment_runner(stub, mode, tag, metadata)
            for mode in ("off", f"fixed{gamma}", "auto")}


def build_runners(target_dir: str, draft_dir: str, gamma: int) -> dict[str, Runner]:
    """transformers and Outrider's in-process engine, on the same checkpoints."""
    from outrider.engine.cross_vocab import CrossVocabDrafter, across_vocabularies
    from outrider.engine.drafter import Drafter
    from outrider.engine.runner import ModelRunner, RunnerConfig
    from outrider.engine.spec_decode import SpeculativeDecoder

    target, draft = load_hf(target_dir), load_hf(draft_dir)
    # float32 as transformers runs here, whatever `auto` would choose
    target_runner = ModelRunner(RunnerConfig(target_dir, dtype="float32"))
    proposer = across_vocabularies(Drafter(ModelRunner(RunnerConfig(draft_dir, dtype="float32"))),
                                   target_dir, draft_dir, target_runner.vocab_size)
    decoder = SpeculativeDecoder(target_runner, proposer)
    tokenizers = None
    if isinstance(proposer, CrossVocabDrafter):
        from transformers import AutoTokenizer

        tokenizers = {"tokenizer": AutoTokenizer.from_pretrained(target_dir),
                      "assistant_tokenizer": AutoTokenizer.from_pretrained(draft_dir)}
    return {"transformers": hf_runner(target),
            "transformers_assisted": hf_runner(target, draft, tokenizers=tokenizers),
            f"transformers_assisted_g{gamma}": hf_runner(target, draft, gamma, tokenizers),
            "outrider_engine_off": engine_runner(decoder, 0),
            f"outrider_engine_g{gamma}": engine_runner(decoder, gamma)}


# -- side by side --------------------------------------------------------------------------
def side_by_side(runners: dict[str, Runner], prompts: list[list[int]], max_tokens: int,
                 progress: bool = True) -> dict[str, dict]:
    """Every prompt through every runner, the order rotating prompt by prompt; per
    runner: tokens, seconds, tokens/s, and on how many prompts its output equals the
    first runner's (the reference)."""
    names = list(runners)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    same = dict.fromkeys(names, 0)
    for i, prompt in enumerate(tqdm(prompts, desc="peer", unit="prompt", disable=not progress)):
        outputs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            outputs[name] = runners[name](prompt, max_tokens)
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(outputs[name])
        for name in names:
            same[name] += outputs[name] == outputs[names[0]]
    return {n: {"tokens": tokens[n], "seconds": seconds[n],
                "tokens_per_s": tokens[n] / seconds[n] if seconds[n] else 0.0,
                "ms_per_token": 1e3 * seconds[n] / tokens[n] if tokens[n] else None,
                "prompts_identical_to_reference": same[n], "prompts": len(prompts)}
            for n in names}


def ratios(results: dict[str, dict], gamma: int) -> dict[str, float | None]:
    """The comparisons the targets ask for (None where a runner did not run)."""
    tps = {name: r["tokens_per_s"] for name, r in results.items()}

    def over(a: str, *b: str) -> float | None:
        base = max((tps[n] for n in b if n in tps), default=None)
        return tps[a] / base if a in tps and base else None

    assisted = ("transformers_assisted", f"transformers_assisted_g{gamma}")
    return {"deployment_auto_over_hf_assisted_best": over("deployment_auto", *assisted),
            "deployment_auto_over_hf_assisted_default": over("deployment_auto", assisted[0]),
            f"deployment_fixed{gamma}_over_hf_assisted_best":
                over(f"deployment_fixed{gamma}", *assisted),
            f"engine_g{gamma}_over_hf_assisted_best": over(f"outrider_engine_g{gamma}", *assisted),
            "engine_off_over_hf": over("outrider_engine_off", "transformers"),
            "hf_assisted_best_over_hf": max((r for r in (over(a, "transformers")
                                                         for a in assisted) if r), default=None),
            "deployment_auto_over_deployment_off": over("deployment_auto", "deployment_off"),
            f"engine_g{gamma}_over_engine_off": over(f"outrider_engine_g{gamma}",
                                                     "outrider_engine_off")}


def compare(target_dir: str, draft_dir: str, prompts: dict[str, list[list[int]]],
            max_tokens: int, gamma: int, stub=None, metadata=(), progress: bool = True) -> dict:
    """The whole comparison, per workload (prompts: workload -> prompt token ids)."""
    local = build_runners(target_dir, draft_dir, gamma)
    report = {"threads": torch.get_num_threads(), "gamma": gamma, "max_tokens": max_tokens,
              "batch": 1, "sampling": "greedy", "reference": "transformers", "workloads": {}}
    for workload, its_prompts in prompts.items():
        runners = local | (deployment_runners(stub, gamma, workload, metadata)
                           if stub is not None else {})
        for run in runners.values():  # warm-up
            run(its_prompts[0], 8)
        results = side_by_side(runners, its_prompts, max_tokens, progress)
        report["workloads"][workload] = {"runners": results, "ratios": ratios(results, gamma)}
    return report


# -- command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from outrider.local_system import LocalSystemConfig

    parser.add_argument("--address", help="router host:port (default: start a local one)")
    parser.add_argument("--no-deployment", action="store_true",
                        help="only transformers and the in-process engine")
    parser.add_argument("--target", default=str(paths.demo_target_dir()))
    parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
    parser.add_argument("--workloads", default="code", help="code and/or text")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=LocalSystemConfig.gamma,
                        help="γ of the fixed runners (and the local deployment's default)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in this process")
    parser.add_argument("--max-batch-tokens", type=int, default=LocalSystemConfig.max_batch_tokens)
    parser.add_argument("--api-key", default=os.environ.get("OUTRIDER_API_KEY"))
    parser.add_argument("--out", default="results/serving_peer.json")
    parser.add_argument("--quiet", action="store_true")


def run(args) -> int:
    started = common.provenance()  # the commit and date the run began with
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer(args.target)
    prompts = {w: workload_prompts(tokenizer, w, args.prompts, args.prompt_tokens)
               for w in common.parse_list(args.workloads)}
    args.replica_gamma = args.gamma
    metadata = common.call_metadata(args.api_key)
    if args.no_deployment:
        report = compare(args.target, args.draft, prompts, args.max_tokens, args.gamma,
                         progress=not args.quiet)
    else:
        with common.deployment(args) as live, grpc.insecure_channel(live.router) as channel:
            report = compare(args.target, args.draft, prompts, args.max_tokens, args.gamma,
                             generate_pb2_grpc.GenerationStub(channel), metadata,
                             progress=not args.quiet)
    report = {"provenance": started,
              "machine": common.machine(), "command": common.command_line(), **report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({w: r["ratios"] for w, r in report["workloads"].items()}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.hf_peer",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
