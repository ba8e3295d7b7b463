"""Acceptance of a draft/target pair on held-out code prompts (batch 1), and the cost
ratio c = draft forward time / target forward time for one decode token. The draft may
be a draft model or a head that reads the target's hidden states (EAGLE-3, EAGLE-1).

    python -m outrider.bench.acceptance [--draft DIR] [--gamma 4] [--prompts 10]
        [--max-tokens 128] [--tree-topk K --tree-tokens N] [--out results/acceptance.json]
        [--vllm VLLM]

With --tree-topk K > 1 the draft proposes token trees γ deep (engine/tree.py), and the
same prompts run as a chain too: both rows are in the report (tree_vs_chain).

With --vllm (a vLLM venv, or the command that runs its CLI: bench.versus), the same
greedy prompts also go through `vllm serve` with the same draft (method eagle3 for a head,
draft_model otherwise), and its acceptance, read from its /metrics, stands beside ours: a
head Outrider trains must be read the same way by the engine its users run.

Defaults to the shipped demo pair and the held-out modules listed in
outrider/bench/data/heldout_modules.txt.
Writes results/acceptance.json and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import time
import urllib.request
from pathlib import Path

import torch

from outrider import paths
from outrider.bench import servers
from outrider.bench.common import SETTINGS as SERVING_SETTINGS
from outrider.bench.common import decode_forward_seconds, provenance
from outrider.bench.prompts import heldout_prompts
from outrider.core.hf_config import head_kind
from outrider.core.sampling import SamplingParams
from outrider.core.stats import SpecStats
from outrider.core.tokenizer import Tokenizer
from outrider.engine.cross_vocab import across_vocabularies
from outrider.engine.drafter import Drafter
from outrider.engine.heads import HeadRunner, TargetSide
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.flags import add_tree_args, tree_shape

# α at the temperatures users run: greedy, T 0.7 / top-p 0.9 and T 1.0 (models/TRAINING.md)
SETTINGS = {name: SERVING_SETTINGS[name] for name in ("greedy", "t0.7-p0.9", "t1.0")}


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


def vllm_acceptance(args, prompts: list[list[int]]) -> dict:
    """Greedy α overall and per draft position in `vllm serve` on `prompts` (token ids),
    from its spec-decode counters."""
    kind = head_kind(args.draft)
    if kind not in (None, "eagle3"):
        raise SystemExit(f"--vllm compares draft models and EAGLE-3 heads; {args.draft} "
                         f"is a {kind} head")
    system = "vllm-eagle3" if kind else "vllm-draft"
    peer = argparse.Namespace(vllm=args.vllm, target=args.target, dtype="auto",
                              head=args.draft, draft=args.draft, gamma=args.gamma)
    with servers.vllm_server(peer, system) as (url, _):
        before = _spec_counters(url)
        for ids in prompts:
            body = {"model": servers.SERVED_NAME, "prompt": ids, "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True}
            request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
        after = _spec_counters(url)
    got = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts, drafted = got["drafts"], got["draft_tokens"]
    per_position = [got.get(f"pos{j}", 0) / drafts for j in range(args.gamma)] if drafts else []
    return {"system": system, "acceptance_rate": got["accepted"] / drafted if drafted else 0.0,
            "acceptance_per_position": per_position, "drafts": drafts,
            "draft_tokens": drafted, "accepted_tokens": got["accepted"]}


def _spec_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted, accepted by position)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = {"vllm:spec_decode_num_drafts_total": "drafts",
             "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[names[name]] = out.get(names[name], 0) + float(line.split()[-1])
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            key = "pos" + re.search(r'position="(\d+)"', line).group(1)
            out[key] = out.get(key, 0) + float(line.split()[-1])
    return out


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
    parser.add_argument("--vllm", help="also through `vllm serve` with the same draft "
                                       "(a vLLM venv, or the command that runs its CLI)")
    add_tree_args(parser)
    args = parser.parse_args()
    tree = tree_shape(args)
    torch.set_num_threads(args.threads)
    if head_kind(args.draft) == "medusa":
        raise SystemExit(f"{args.draft}: Medusa heads are not measured here (EAGLE heads and "
                         f"draft models are)")
    target = ModelRunner(RunnerConfig(args.target))
    draft = (HeadRunner(RunnerConfig(args.draft), TargetSide.of_runner(target))
             if head_kind(args.draft)
             else ModelRunner(RunnerConfig(args.draft)))
    # trees on every round (TreeChoice would keep greedy steps on the faster kind)
    proposer = (across_vocabularies(Drafter(draft), args.target, args.draft, target.vocab_size)
                if not head_kind(args.draft) else Drafter(draft))
    decoder = SpeculativeDecoder(target, proposer, tree=tree, choose_trees=False)
    prompts = heldout_prompts(Tokenizer(args.target), args.prompts, args.prompt_tokens)
    report = {"provenance": provenance(),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}",
              "draft": Path(args.draft).name,
              "command": f"python -m outrider.bench.acceptance --draft {args.draft} "
                         f"--gamma {args.gamma} "
                         f"--prompts {args.prompts} --max-tokens {args.max_tokens} "
                         f"--threads {args.threads}"
                         + (f" --tree-topk {tree.topk} --tree-tokens {tree.tokens}"
                            if not tree.is_chain else "")
                         + (f" --vllm '{args.vllm}'" if args.vllm else ""),
              "tree": dataclasses.asdict(tree),
              "gamma": args.gamma, "settings": {}}
    for name, sampling in SETTINGS.items():
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **sampling)
        row = run_setting(decoder, prompts, params, args.gamma)
        row["target_only_tokens_per_s"] = run_setting(decoder, prompts, params, 0)["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / row["target_only_tokens_per_s"]
        if decoder.tree is not None:  # the same draft as a chain, for the tree's gain
            chain = run_setting(SpeculativeDecoder(target, Drafter(draft)), prompts, params,
                                args.gamma)
            row["chain"] = chain
            row["tree_vs_chain"] = (row["mean_accepted_tokens_per_round"]
                                    / chain["mean_accepted_tokens_per_round"])
        report["settings"][name] = row
    target_s = decode_forward_seconds(target, args.prompt_tokens)
    tap = getattr(draft, "reads", None)
    draft_s = decode_forward_seconds(draft, args.prompt_tokens, feature_width=tap.width(
        target.model_config.hidden_size) if tap else 0)
    report["forward_ms"] = {"target": target_s * 1e3, "draft": draft_s * 1e3}
    report["c"] = draft_s / target_s
    if args.vllm:
        report["vllm"] = vllm_acceptance(args, prompts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
