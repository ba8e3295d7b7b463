"""`outrider demo`: the whole system on the shipped demo pair, in one command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from outrider import paths
from outrider.cli.generate import stats_line

DEMO_MODULE = "glob.py"  # a held-out module: never seen in training


def demo_flags(demo: argparse.ArgumentParser) -> None:
    from outrider.target_worker.main import TargetWorkerConfig

    demo.add_argument("--max-tokens", type=int, default=160, help="tokens to generate")
    demo.add_argument("--gamma", type=int, default=TargetWorkerConfig.gamma,
                      help="draft tokens per round")


def cmd_demo(args) -> int:
    """The whole system on the demo pair: router, target and draft replicas as processes;
    one generation streamed through the router, then the target alone for comparison."""
    from outrider.client import Client
    from outrider.local_system import LocalSystemConfig, local_system

    prompt = _demo_prompt()
    target, draft = paths.demo_pair()
    cfg = LocalSystemConfig(str(target), str(draft), grpc_port=0, speculation_cache=True)
    print("== starting router, target replica and draft replica (processes, gRPC; the "
          "draft replica with its speculation cache) ==", flush=True)
    with local_system(cfg) as system, Client(system.router, timeout_s=600) as client:
        print(f"router listening on {system.router}", flush=True)
        # first: the cache measured on the traffic it is for (under AUTO, lookups lead and
        # a cache that does not pay prepares only now and then: DESIGN §2.6)
        _demo_cache(client, str(target), args.gamma)
        print(f"\n== prompt: the head of held-out module {DEMO_MODULE} ==\n{prompt}",
              flush=True)
        print(f"== through the router: target + draft, greedy, γ = {args.gamma} ==", flush=True)
        options = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        stream = client.stream(prompt, speculation="fixed", gamma_max=args.gamma, **options)
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        spec = stream.result()
        plain = client.generate(prompt, speculation="off", **options)
        print("\n" + stats_line(spec))
        _print_comparison(spec, plain)
        _demo_sampled(client, prompt, args.max_tokens)
    drafted = {"draft model": spec}
    for name, (folder, where) in OTHER_DRAFTS.items():
        if (folder() / "config.json").is_file():
            drafted[name] = _demo_other_draft(str(target), str(folder()), where, prompt,
                                              options, args.gamma, plain)
    print("acceptance per proposer (α = accepted / drafted; tokens per round):")
    for name, result in drafted.items():
        s = result.speculation
        print(f"  {name:15} α {s.acceptance_rate:.2f}, {s.mean_accepted_len:.2f} tokens/round, "
              f"{result.timings.tokens_per_s:.1f} tok/s")
    return 0


# the drafts shown after the draft model: (their folder, where and how they draft)
OTHER_DRAFTS = {
    "EAGLE-3 head": (paths.demo_head_dir, "a draft head: EAGLE-3 ({name}), in the target "
                                          "replica's process"),
    "own tokenizer": (paths.demo_cross_draft_dir, "a draft with its own tokenizer ({name}, a "
                                                  "2,048-token BPE) on a draft replica, "
                                                  "proposing the target's tokens through text"),
}


def _demo_other_draft(target: str, draft: str, where: str, prompt: str, options: dict,
                      gamma: int, plain):
    """The same generation drafted another way, in a system of its own."""
    from outrider.client import Client
    from outrider.local_system import LocalSystemConfig, local_system

    print(f"\n== the same through {where.format(name=Path(draft).name)}, greedy, "
          f"γ = {gamma} ==", flush=True)
    with local_system(LocalSystemConfig(target, draft, grpc_port=0)) as system, \
            Client(system.router, timeout_s=600) as client:
        stream = client.stream(prompt, speculation="fixed", gamma_max=gamma, **options)
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        result = stream.result()
    print("\n" + stats_line(result))
    _print_comparison(result, plain)
    return result


CACHE_STREAMS = 8  # beyond the 2 that draft ahead instead (docs/DESIGN.md §2.5-2.6)


def _demo_cache(client, target: str, gamma: int) -> None:
    """Several greedy streams at once (held-out modules' heads): the draft replica drafts
    each round's likely outcomes while the target verifies, and rounds whose outcome it
    prepared take their drafts without waiting for the draft model."""
    from outrider.bench.prompts import heldout_prompts
    from outrider.core.tokenizer import Tokenizer

    print(f"== {CACHE_STREAMS} streams at once (held-out modules), greedy, γ = {gamma}, "
          f"the draft model drafting: drafts prepared in the draft replica's speculation "
          f"cache ==", flush=True)
    prompts = heldout_prompts(Tokenizer(target), CACHE_STREAMS, 128)
    batch = dict(max_concurrency=CACHE_STREAMS, max_tokens=96, temperature=0.0,
                 ignore_eos=True)
    spec = client.generate_batch(prompts, speculation="fixed", gamma_max=gamma,
                                 proposer="model", include_rounds=True, **batch)
    plain = client.generate_batch(prompts, speculation="off", **batch)
    rounds = [r for g in spec for r in g.rounds if r.gamma]
    ready = sum(r.cache_rank > 0 for r in rounds)
    drafted = sum(r.gamma for r in rounds)
    accepted = sum(r.num_accepted for r in rounds)
    same = all(s.token_ids == p.token_ids for s, p in zip(spec, plain))
    print(f"rounds {len(rounds)}, of which {ready} ({ready / max(1, len(rounds)):.0%}) took "
          f"drafts ready in the cache; α = {accepted / max(1, drafted):.3f}; output "
          f"{'identical' if same else 'DIFFERENT'} to the target's own greedy output")


SAMPLED = dict(temperature=0.7, top_p=0.9, seed=7)  # what production traffic runs at


def _demo_sampled(client, prompt: str, max_tokens: int) -> None:
    """The same prompt sampled, as users run it: AUTO (the γ policy, which drafts only
    where it pays at this temperature) against speculation off, both seeded."""
    print(f"\n== sampled (temperature {SAMPLED['temperature']}, top-p {SAMPLED['top_p']}, "
          f"seed {SAMPLED['seed']}): AUTO against speculation off ==", flush=True)
    options = dict(max_tokens=max_tokens, ignore_eos=True, **SAMPLED)
    auto = client.generate(prompt, speculation="auto", **options)
    plain = client.generate(prompt, speculation="off", **options)
    print(auto.text[:240] + ("…" if len(auto.text) > 240 else ""))
    print(stats_line(auto))
    print(f"speculation off: {plain.timings.tokens_per_s:.1f} tok/s; AUTO's speedup "
          f"{auto.timings.tokens_per_s / plain.timings.tokens_per_s:.2f}x; sampled output "
          f"follows the target's own distribution exactly (rejection sampling; the χ² "
          f"suites test it), so a seed's tokens depend on the rounds' γ, not its law")


def _print_comparison(spec, plain) -> None:
    """Speculation's speedup, and the proof it changed nothing: greedy output is the
    target's own."""
    same = "identical" if plain.token_ids == spec.token_ids else "DIFFERENT"
    print(f"target alone (speculation off): {plain.timings.tokens_per_s:.1f} tok/s; "
          f"speculative speedup {spec.timings.tokens_per_s / plain.timings.tokens_per_s:.2f}x; "
          f"output {same} to the target's own greedy output")


def _demo_prompt() -> str:
    """The held-out module's head, up to and including its first function signature."""
    import sysconfig

    lines = Path(sysconfig.get_paths()["stdlib"], DEMO_MODULE).read_text().splitlines()
    first_def = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "\n".join(lines[:first_def + 1]) + "\n"
