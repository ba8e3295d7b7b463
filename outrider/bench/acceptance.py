"""Acceptance of a draft/target pair on held-out code prompts (batch 1), and the cost
ratio c = draft forward time / target forward time for one decode token.

    python -m outrider.bench.acceptance [--gamma 4] [--prompts 10] [--max-tokens 128]

Defaults to the shipped demo pair and the held-out modules listed in
outrider/bench/data/heldout_modules.txt.
Writes results/acceptance.json and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from outrider import paths
from outrider.bench.common import provenance
from outrider.core.sampling import SamplingParams
from outrider.core.stats import SpecStats
from outrider.core.tokenizer import Tokenizer
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder

SETTINGS = {"greedy": dict(temperature=0.0),
            "t0.7-p0.95": dict(temperature=0.7, top_p=0.95)}


def heldout_prompts(tokenizer: Tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` tokens of each held-out standard-library module."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = paths.heldout_modules_file().read_text().split()[:num_prompts]
    return [tokenizer.encode((stdlib / m).read_text())[:prompt_tokens] for m in modules]


def run_setting(decoder: SpeculativeDecoder, prompts, params: SamplingParams,
                gamma: int) -> dict:
    total, num_tokens, start = SpecStats(), 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        seq = decoder.generate([prompt], dataclasses.replace(params, seed=i),
                               gamma)[0]
        num_tokens += seq.num_output
        total.merge(seq.stats)
    seconds = time.perf_counter() - start
    return {
        "acceptance_rate": total.acceptance_rate,
        "acceptance_per_position": total.acceptance_per_position,
        # emitted per round = accepted draft tokens + the recovered/bonus token
        "mean_accepted_tokens_per_round": total.mean_accepted_len,
        "mean_accepted_draft_tokens_per_round": (total.num_accepted_tokens / total.num_rounds
                                                 if total.num_rounds else 0.0),
        "tokens": num_tokens, "seconds": seconds, "tokens_per_s": num_tokens / seconds,
    }


def decode_forward_seconds(runner: ModelRunner, context_len: int, repeats: int = 50) -> float:
    """Median time of one single-token decode forward at batch 1 after `context_len` tokens."""
    blocks, seq_id = runner.blocks, "cost-probe"
    blocks.append(seq_id, context_len)
    runner.forward([ForwardRequest([1] * context_len, 0, blocks.block_table(seq_id), 1)])
    times = []
    for _ in range(repeats):
        blocks.append(seq_id, 1)
        start = time.perf_counter()
        runner.forward([ForwardRequest([1], context_len, blocks.block_table(seq_id), 1)])
        times.append(time.perf_counter() - start)
        blocks.rollback(seq_id, context_len)
    blocks.free(seq_id)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(paths.demo_target_dir()))
    parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/acceptance.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = ModelRunner(RunnerConfig(args.target)), ModelRunner(RunnerConfig(args.draft))
    decoder = SpeculativeDecoder(target, Drafter(draft))
    prompts = heldout_prompts(Tokenizer(args.target), args.prompts, args.prompt_tokens)
    report = {"provenance": provenance(),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}",
              "command": f"python -m outrider.bench.acceptance --gamma {args.gamma} "
                         f"--prompts {args.prompts} --max-tokens {args.max_tokens} "
                         f"--threads {args.threads}",
              "gamma": args.gamma, "settings": {}}
    for name, sampling in SETTINGS.items():
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **sampling)
        row = run_setting(decoder, prompts, params, args.gamma)
        row["target_only_tokens_per_s"] = run_setting(decoder, prompts, params, 0)["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / row["target_only_tokens_per_s"]
        report["settings"][name] = row
    target_s = decode_forward_seconds(target, args.prompt_tokens)
    draft_s = decode_forward_seconds(draft, args.prompt_tokens)
    report["forward_ms"] = {"target": target_s * 1e3, "draft": draft_s * 1e3}
    report["c"] = draft_s / target_s
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
