"""Served A/B of target-worker flags: which setting serves more, and where its steps go.

    python scripts/served_ab.py --variants "default;--threads 1" [--concurrency 32,64]
        [--modes auto,off] [--rounds 2] [--prompts 64] [--dtype auto] [--target DIR]
        [--sampling greedy] [--out results/served_ab.json]

Each variant is a `outrider serve`-like deployment on the demo pair, or --target with the
demo draft (router, target and
draft replicas as processes, every default as `outrider serve` has it, the variant's
flags added to the target replica's, but for `--speculation-cache`,
`--cache-aware-sampling W` (the draft replicas' cache), `--env NAME=VALUE` (in every
process's environment), `--draft DIR` (another draft:
one of its own tokenizer proposes through text) and `--draft-cpus LIST` (the draft replica
and the router on those cores alone, the target on the others, no CPU plan: a draft on
hardware of its own), which are serve's), driven by
`outrider bench`'s gRPC client (code prompts, greedy or --sampling, 96 tokens, EOS
ignored). Rounds take the variants in turn, the order
reversed every other round, so the machine's noise meets each alike. Per variant, mode
and level: tok/s and TTFT p50 as the client saw them, then from the replicas' metrics the
engine thread's step (ms, and the shares on its CPU, waiting for the proposer, waiting
otherwise), the share of rounds whose drafts the speculation cache had ready, and the
draft replica's time per Propose.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import urllib.request
from pathlib import Path

import grpc

from outrider import paths
from outrider.bench import serving
from outrider.bench.common import (
    SETTINGS,
    Mode,
    command_line,
    machine,
    provenance,
    workload_prompts,
)
from outrider.bench.versus import engine_cell, engine_counters
from outrider.core.tokenizer import Tokenizer
from outrider.cpus import available_cpus, format_cpus, parse_cpus
from outrider.local_system import LocalSystemConfig, local_system
from outrider.v1 import generate_pb2_grpc


def propose_seconds(metrics: str) -> tuple[float, float]:
    """(Propose calls, seconds in them) of a draft replica so far."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    found = {s.name: s.value for f in text_string_to_metric_families(text)
             for s in f.samples if s.name.startswith("outrider_draft_propose_seconds")}
    return (found.get("outrider_draft_propose_seconds_count", 0.0),
            found.get("outrider_draft_propose_seconds_sum", 0.0))


def measure(variant: str, plan: serving.Plan, dtype: str, target: str) -> list[dict]:
    """Every (mode, level) of the plan on a fresh deployment with the variant's flags."""
    draft = str(paths.demo_draft_dir(must_exist=True))
    serve_level = argparse.ArgumentParser(add_help=False)  # the draft replicas' flags
    serve_level.add_argument("--speculation-cache", action="store_true")
    serve_level.add_argument("--cache-aware-sampling", type=float)
    serve_level.add_argument("--draft", default=draft)
    # the draft replica (and the router) on these cores alone, the target on the others,
    # no CPU plan: a draft on hardware of its own
    serve_level.add_argument("--draft-cpus")
    # NAME=VALUE in every process's environment (e.g. OMP_WAIT_POLICY=PASSIVE)
    serve_level.add_argument("--env", action="append", default=[])
    drafts, extra = serve_level.parse_known_args([] if variant == "default"
                                                 else shlex.split(variant))
    apart = {}
    if drafts.draft_cpus:
        others = format_cpus(sorted(set(available_cpus()) - set(parse_cpus(drafts.draft_cpus))))
        apart = dict(pin_cpus=False, extra_draft_args=("--cpus", drafts.draft_cpus),
                     extra_router_args=("--cpus", drafts.draft_cpus))
        extra = [*extra, "--cpus", others]
    cfg = LocalSystemConfig(target, drafts.draft, grpc_port=0, metrics=True,
                            extra_target_args=tuple(extra), dtype=dtype,
                            speculation_cache=drafts.speculation_cache,
                            cache_aware_sampling=drafts.cache_aware_sampling, **apart)
    rows = []
    env = dict(pair.split("=", 1) for pair in drafts.env) or None
    with local_system(cfg, env=env) as system, grpc.insecure_channel(system.router) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        engine = [f"http://{system.metrics['target']}"]
        serving.warm_up(stub, plan, ())
        for level in plan.levels:
            for mode in plan.modes:
                one = serving.Plan(plan.prompts, plan.samplings, [mode], [level],
                                   plan.max_tokens, plan.seed, plan.repeats)
                before, calls = engine_counters(engine), propose_seconds(system.metrics["draft-0"])
                row = serving.sweep(stub, one, (), progress=False)[0]
                after, calls_after = engine_counters(engine), propose_seconds(
                    system.metrics["draft-0"])
                count, seconds = (b - a for a, b in zip(calls, calls_after))
                row = {"variant": variant, "mode": mode.name, "concurrency": level,
                       "tokens_per_s": row["tokens_per_s"], "ttft_ms_p50": row["ttft_ms_p50"],
                       **engine_cell(before, after, row["seconds"]),
                       "draft_propose_ms": 1000 * seconds / count if count else None}
                rows.append(row)
                print(f"{variant!r} {mode.name} x{level}: {row['tokens_per_s']:.0f} tok/s, "
                      f"TTFT {row['ttft_ms_p50']:.0f} ms, step {row['engine_step_ms']:.1f} ms "
                      f"({row['engine_cpu']:.0%} CPU, {row['engine_proposer_wait']:.0%} "
                      f"proposer, {row['engine_other_wait']:.0%} other)", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="default",
                        help="target-worker flags per variant, ';'-separated ('default': none)")
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--modes", default="auto,off")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="of both models (as serve's --dtype)")
    parser.add_argument("--target", default=str(paths.demo_target_dir()),
                        help="the target checkpoint (the demo draft proposes: its tokenizer)")
    parser.add_argument("--sampling", default="greedy", choices=list(SETTINGS))
    parser.add_argument("--out", default="results/served_ab.json")
    args = parser.parse_args()
    target = args.target
    if not Path(target, "config.json").is_file():
        parser.error(f"no model at {target}")
    plan = serving.Plan(prompts={"code": workload_prompts(Tokenizer(target), "code",
                                                          args.prompts, 128)},
                        samplings=[args.sampling], modes=[Mode.parse(m) for m in
                                                     args.modes.split(",")],
                        levels=[int(c) for c in args.concurrency.split(",")], max_tokens=96,
                        seed=0, repeats=1)
    variants = [v.strip() for v in args.variants.split(";")]
    rounds = [[measure(v, plan, args.dtype, target)
               for v in (variants if r % 2 == 0 else variants[::-1])]
              for r in range(args.rounds)]
    report = {"provenance": provenance(), "machine": machine(), "command": command_line(),
              "variants": variants, "config": {"prompts": args.prompts, "max_tokens": 96,
                                               "dtype": args.dtype,
                                               "prompt_tokens": 128,
                                               "sampling": args.sampling},
              "rows": [row for one in rounds for rows in one for row in rows]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
