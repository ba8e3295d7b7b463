"""Offline sweep of the drafts' online distillation (docs/DESIGN.md §8.6): which training
signal and how much training move acceptance, without serving.

    python scripts/distill_sweep.py [--sequences 1700] [--variants ce,mix,mix-steps40]
        [--out results/distill_sweep.json] [--cache /tmp/distill_stream.pt]

The demo target answers windows of 128 tokens of third-party package code (the stream
`outrider bench --adapt` serves, outrider/bench/adapt.py) greedily, 128 tokens each; its
top-16 at every output position is kept. The last 200 sequences are the test set; the
others stream through a `TrafficBuffer` and the real `Distiller` as served traffic would
(a round every 4,000 output tokens, adoption by the held-out test of distill.py), and
every 40K tokens the serving weights are scored on the test set: teacher-forced top-1
agreement, and the γ-4 acceptance (accepted / drafted) greedy drafting would get.
Also reported: the share of the shipped draft's misses that copying from the context
(the token after the last earlier occurrence of the two before) would have got right.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from outrider import paths
from outrider.bench import common
from outrider.bench.adapt import prompts
from outrider.core.sampling import SamplingParams
from outrider.engine.distill import (
    DistillConfig,
    Distiller,
    Served,
    TrafficBuffer,
    agreed,
    causal_logits,
    trainable_copy,
)
from outrider.engine.local import LocalEngine, LocalEngineConfig
from outrider.engine.runner import ModelRunner, RunnerConfig

PROMPT, OUTPUT, TOPK, TEST, EVERY = 128, 128, 16, 200, 40_000
VARIANTS = {"ce": dict(target_topk=0), "mix": dict(target_topk=TOPK),
            "mix-steps40": dict(target_topk=TOPK, steps_per_round=40),
            "mix-lr3e-4": dict(target_topk=TOPK, lr=3e-4),
            "mix-evidence0": dict(target_topk=TOPK, min_evidence=0.0),
            "mix-heldout64": dict(target_topk=TOPK, heldout_eval=64),
            "mix-evidence0-heldout64": dict(target_topk=TOPK, min_evidence=0.0, heldout_eval=64)}


def served_stream(num: int) -> list[tuple[Served, dict]]:
    """(sequence, its top-k rows by position) for `num` prompts, answered greedily."""
    engine = LocalEngine(LocalEngineConfig(RunnerConfig(str(paths.demo_target_dir()))))
    windows = [w for w in (engine.tokenizer.encode(t)[:PROMPT]
                           for t in prompts(engine.tokenizer, PROMPT, num)) if len(w) == PROMPT]
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    seqs = [s.token_ids for b in range(0, len(windows), 128)
            for s in engine.decoder.generate(windows[b:b + 128], params, 0)]
    model = engine.decoder.target.build_model().eval()
    out = []
    with torch.no_grad():
        for b in range(0, len(seqs), 32):
            ids = torch.tensor(seqs[b:b + 32])  # [32, PROMPT + OUTPUT]
            top = causal_logits(model, ids).log_softmax(-1)[:, PROMPT - 1:-1].topk(TOPK, -1)
            for row, top_ids, top_lps in zip(ids.tolist(), top.indices.tolist(),
                                             top.values.tolist()):
                rows = {PROMPT + j: (i, lp) for j, (i, lp) in enumerate(zip(top_ids, top_lps))}
                out.append((Served(tuple(row), PROMPT), rows))
    return out


def gamma_acceptance(hits: list[bool], gamma: int = 4) -> tuple[int, int]:
    """(accepted, drafted) of greedy rounds of γ drafts along one sequence's positions."""
    accepted = drafted = t = 0
    while t + gamma < len(hits):
        run = 0
        while run < gamma and hits[t + run]:
            run += 1
        accepted, drafted, t = accepted + run, drafted + gamma, t + run + 1
    return accepted, drafted


def score(model, test: list[Served]) -> dict:
    per_seq = [agreed(model, [s]).tolist() for s in test]
    counts = [gamma_acceptance(h) for h in per_seq]
    return {"agreement": sum(map(sum, per_seq)) / sum(map(len, per_seq)),
            "acceptance_gamma4": sum(a for a, _ in counts) / sum(d for _, d in counts)}


def run_variant(name: str, stream, test: list[Served], runner: ModelRunner) -> dict:
    cfg = replace(DistillConfig(max_duty=1.0), **VARIANTS[name])
    buffer, distiller = TrafficBuffer(cfg), Distiller(runner, cfg)
    serving, served, adoptions, start = trainable_copy(runner).eval(), 0, 0, time.time()
    curve = [{"served_tokens": 0, **score(serving, test)}]
    for s, rows in stream:
        buffer.add(list(s.token_ids), s.prompt_len, rows)
        served += s.num_output
        if buffer.is_ready():
            verdict = distiller.train_round(buffer, serving)
            if verdict.weights is not None:
                serving, adoptions = trainable_copy(runner, verdict.weights).eval(), adoptions + 1
            elif verdict.is_astray:
                distiller.restart(serving.state_dict())
        if served // EVERY > (served - s.num_output) // EVERY:
            curve.append({"served_tokens": served, "adoptions": adoptions, **score(serving, test)})
            print(name, curve[-1], f"{time.time() - start:.0f} s", flush=True)
    if curve[-1]["served_tokens"] != served:  # the stream's end
        curve.append({"served_tokens": served, "adoptions": adoptions, **score(serving, test)})
    return {"config": VARIANTS[name], "curve": curve, "seconds": time.time() - start}


def copyable_misses(runner: ModelRunner, test: list[Served]) -> dict:
    model, misses, copyable = trainable_copy(runner).eval(), 0, 0
    for s in test:
        hits = agreed(model, [s]).tolist()
        for j, hit in enumerate(hits):
            t = s.prompt_len + j
            if hit:
                continue
            misses += 1
            a, b, row = s.token_ids[t - 2], s.token_ids[t - 1], s.token_ids
            after = next((row[i + 2] for i in range(t - 3, -1, -1)
                          if row[i] == a and row[i + 1] == b), None)
            copyable += after == row[t]
    return {"misses": misses, "copyable": copyable, "share": copyable / misses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=1700)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="results/distill_sweep.json")
    parser.add_argument("--cache", help="keep the generated stream in this file (torch.save) "
                                        "and reuse it when it is there")
    args = parser.parse_args()
    if args.cache and Path(args.cache).exists():
        data = torch.load(args.cache, weights_only=False)
    else:
        data = served_stream(args.sequences)
        if args.cache:
            torch.save(data, args.cache)
    stream, test = data[:-TEST], [s for s, _ in data[-TEST:]]
    runner = ModelRunner(RunnerConfig(str(paths.demo_draft_dir()), kv_cache_mb=8))
    report = {"provenance": common.provenance(),
              "machine": common.machine(), "command": f"python {shlex.join(sys.argv)}",
              "sequences": len(data), "test_sequences": len(test),
              "copyable_misses_of_the_shipped_draft": copyable_misses(runner, test),
              "variants": {v: run_variant(v, stream, test, runner)
                           for v in args.variants.split(",")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({v: r["curve"][-1] for v, r in report["variants"].items()}, indent=2))


if __name__ == "__main__":
    main()
