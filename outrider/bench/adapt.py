"""Drafts that learn while they serve: acceptance and batch-1 speed against tokens served.

    outrider bench --adapt [--served-tokens 200000] [--minutes 30] [--prompt-tokens 128]
        [--max-tokens 128] [--out results/adapt.json] [--plots-dir docs/figures]
    (or: python -m outrider.bench.adapt ...)

`outrider serve --adapt` on the demo pair; one request at a time (batch 1, greedy, EOS
ignored) through the gRPC SDK, on a stream of code the pair never saw: windows of
--prompt-tokens tokens of source files of third-party packages installed beside Outrider
(never the standard library, the pair's training data), up to 8 per file, shuffled, none
repeated, until --served-tokens output tokens or --minutes. Per request: acceptance
(accepted / drafted tokens), tokens/s, and, from the draft replica's /metrics polled
every 0.25 s, the draft version serving and whether a training round was running.

Training's cost to serving: the requests served before the first adoption (the shipped
weights, with training running) are then replayed on a fresh `outrider serve` without
--adapt, and their tokens/s compared.

What was learnt, without the noise of which prompts came when: the system runs with a
throwaway redis-server, so the last version's weights can be read back as the draft
replicas share them (safetensors); --probe windows never served are then drafted for, in
this process and greedy with γ --gamma, by the shipped weights and by the last version,
and the two acceptances compared on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from outrider import paths
from outrider.bench import common
from outrider.bench.prompts import package_sources
from outrider.flags import PROPOSERS
from outrider.launch import redis_server

DEFAULT_OUT = "results/adapt.json"
WINDOW = 100  # requests per point of the curves


@dataclass(frozen=True)
class Served:
    index: int
    served_tokens: int   # output tokens served before this request ended
    drafted: int
    accepted: int
    tokens_per_s: float
    version: int         # the draft version serving when it ended
    training_share: float  # of the request's polls, the share with a round training
    rounds: int = 0      # speculative rounds (tokens per round: its tokens / rounds)
    by_proposer: dict = field(default_factory=dict)  # method -> (drafted, kept)


class DraftWatch:
    """Polls the draft replica's /metrics: its version and whether it trains."""

    def __init__(self, address: str) -> None:
        self.url = f"http://{address}/metrics"
        self.samples: list[tuple[float, int, bool]] = []  # (time, version, training)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DraftWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                continue
            self.samples.append((time.monotonic(), int(_gauge(text, "outrider:draft_version")),
                                 _gauge(text, "outrider_draft_training") > 0))

    def between(self, start: float, end: float) -> tuple[int, float]:
        """(the last version seen, the share of polls with a round training)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        version = self.samples[-1][1] if self.samples else 0
        return version, (sum(s[2] for s in inside) / len(inside) if inside else 0.0)


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def prompts(tokenizer, prompt_tokens: int, limit: int, seed: int = 0) -> list[str]:
    """Non-overlapping windows of `prompt_tokens` tokens, at most 8 per file, of
    third-party package files taken in a shuffled order until there are `limit`,
    shuffled: new code at every request, none repeated. (Tokenizing every file took
    ~10 s, where a short run needs a few dozen windows.)"""
    rng = random.Random(seed)
    files = package_sources()
    rng.shuffle(files)
    out = []
    for f in files:
        if len(out) >= limit:
            break
        ids = tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        stride = max(2 * prompt_tokens, len(ids) // 8)
        out += [tokenizer.decode(ids[s:s + prompt_tokens])
                for s in range(0, len(ids) - 2 * prompt_tokens, stride)]
    rng.shuffle(out)
    return out[:limit]


def serve_stream(client, watch: DraftWatch, texts: list[str], args, log,
                 limit: int) -> list[Served]:
    """Batch 1 through `texts` until `limit` output tokens (or --minutes)."""
    results, served, deadline = [], 0, time.monotonic() + 60 * args.minutes
    for i, text in enumerate(texts):
        if served >= limit or time.monotonic() > deadline:
            break
        start = time.monotonic()
        g = client.generate(text, max_tokens=args.max_tokens, temperature=0.0,
                            ignore_eos=True, speculation="fixed", gamma_max=args.gamma)
        served += len(g.token_ids)
        version, share = watch.between(start, time.monotonic())
        results.append(Served(i, served, g.speculation.draft_tokens,
                              g.speculation.accepted_tokens, g.timings.tokens_per_s,
                              version, share, g.speculation.rounds,
                              g.speculation.by_proposer))
        if i % WINDOW == WINDOW - 1:
            window = results[-WINDOW:]
            log(f"{served} tokens: acceptance {_acceptance(window):.3f}, "
                f"{statistics.mean(r.tokens_per_s for r in window):.0f} tok/s, "
                f"draft v{version}")
    return results


def _acceptance(rows: list[Served]) -> float:
    drafted = sum(r.drafted for r in rows)
    return sum(r.accepted for r in rows) / drafted if drafted else 0.0


def curves(results: list[Served]) -> list[dict]:
    """One point per full window of WINDOW requests (one for all of a shorter run)."""
    size = min(WINDOW, len(results))
    return [{"served_tokens": w[-1].served_tokens, "acceptance": _acceptance(w),
             "tokens_per_s": statistics.mean(r.tokens_per_s for r in w),
             "version": w[-1].version}
            for w in (results[i:i + size] for i in range(0, len(results) - size + 1, size))]


def summary(results: list[Served], points: list[dict], baseline: list[Served],
            target: float = 0.85) -> dict:
    """The curve's ends; where it first reached `target`; and training's cost: the
    requests served before the first adoption (the shipped weights) against the same
    requests on a system without training."""
    reached = next((p["served_tokens"] for p in points if p["acceptance"] >= target), None)
    training = [r.tokens_per_s for r in results if r.training_share >= 1.0]
    idle = [r.tokens_per_s for r in results if r.training_share == 0.0]
    train_acc = _acceptance([r for r in results if r.training_share >= 1.0])
    idle_acc = _acceptance([r for r in results if r.training_share == 0.0])
    same = results[:len(baseline)]
    return {
        "tokens_per_s_shipped_weights_training": statistics.mean(r.tokens_per_s for r in same),
        "tokens_per_s_shipped_weights_no_training": statistics.mean(
            r.tokens_per_s for r in baseline),
        "requests_compared": len(baseline),
        "first_acceptance": points[0]["acceptance"], "last_acceptance": points[-1]["acceptance"],
        "first_tokens_per_s": points[0]["tokens_per_s"],
        "last_tokens_per_s": points[-1]["tokens_per_s"],
        "served_tokens": results[-1].served_tokens, "final_version": results[-1].version,
        f"served_tokens_to_{target}": reached,
        "tokens_per_s_while_training": statistics.mean(training) if training else None,
        "tokens_per_s_between_rounds": statistics.mean(idle) if idle else None,
        "acceptance_while_training": train_acc, "acceptance_between_rounds": idle_acc,
        "requests_while_training": len(training), "requests_between_rounds": len(idle),
        "acceptance_by_version": {str(v): _acceptance([r for r in results if r.version == v])
                                  for v in sorted({r.version for r in results})},
        # accepted tokens per round, the whole stream (what --proposer changes, §2.8)
        "accepted_per_round": (sum(r.accepted for r in results)
                               / max(1, sum(r.rounds for r in results))),
        "by_proposer": _by_proposer(results)}


def _by_proposer(results: list[Served]) -> dict[str, list[int]]:
    """method -> [drafted, accepted] over the stream."""
    out: dict[str, list[int]] = {}
    for r in results:
        for method, (drafted, kept) in r.by_proposer.items():
            totals = out.setdefault(method, [0, 0])
            totals[0] += drafted
            totals[1] += kept
    return out


def plot(points: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["served_tokens"] / 1000 for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.plot(x, [p["acceptance"] for p in points], marker=".")
    a.axhline(0.85, color="grey", linestyle="--", linewidth=0.8)
    a.set_xlabel("output tokens served (thousands)")
    a.set_title("draft acceptance (greedy, γ 4)")
    b.plot(x, [p["tokens_per_s"] for p in points], marker=".", color="tab:green")
    b.set_xlabel("output tokens served (thousands)")
    b.set_title("batch-1 tokens/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)


def add_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    if standalone:
        parser.add_argument("--target", default=str(paths.demo_target_dir()))
        parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
        parser.add_argument("--gamma", type=int, default=4)
        parser.add_argument("--max-tokens", type=int, default=128)
        parser.add_argument("--prompt-tokens", type=int, default=128)
        parser.add_argument("--out", default=DEFAULT_OUT)
        parser.add_argument("--plots-dir", default=None)
    parser.add_argument("--served-tokens", type=int, default=200_000,
                        help="stop after this many output tokens (adapt)")
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="or after this long (adapt)")
    parser.add_argument("--adapt-proposer", choices=PROPOSERS, default="auto",
                        help="the served system's --proposer (adapt; default: auto)")
    parser.add_argument("--probe", type=int, default=200,
                        help="windows held back from the stream: shipped against learnt "
                             "weights on the same prompts (adapt)")


def run(args) -> int:
    from outrider.core.tokenizer import Tokenizer

    started = common.provenance()  # the commit and date the run began with
    log = lambda text: print(f"[adapt] {text}", file=sys.stderr, flush=True)  # noqa: E731
    tokenizer = Tokenizer(args.target)
    # every request serves max_tokens (EOS ignored): the stream needs served/max of them
    texts = prompts(tokenizer, args.prompt_tokens,
                    -(-args.served_tokens // args.max_tokens) + args.probe)
    texts, probe = texts[:-args.probe], texts[-args.probe:]
    with tempfile.TemporaryDirectory() as redis_dir, redis_server(redis_dir) as redis_url:
        results, learnt = serve_system(args, texts, True, log, args.served_tokens, redis_url)
    first_adoption = next((i for i, r in enumerate(results) if r.version), len(results))
    log(f"the same {first_adoption} requests without training")
    baseline, _ = serve_system(args, texts, False, log,
                               results[first_adoption - 1].served_tokens)
    log(f"{len(probe)} unseen prompts, shipped weights against version {learnt[0]}")
    probe_ids = [tokenizer.encode(t) for t in probe]
    points = curves(results)
    report = {"provenance": started,
              "machine": common.machine(), "command": common.command_line(),
              "config": {"served_tokens": args.served_tokens, "minutes": args.minutes,
                         "proposer": args.adapt_proposer,
                         "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                         "gamma": args.gamma, "prompts": len(texts), "probe": len(probe)},
              "summary": summary(results, points, baseline),
              "probe": {"version": learnt[0],
                        "acceptance_shipped": probe_acceptance(args, probe_ids, None),
                        "acceptance_learnt": probe_acceptance(args, probe_ids, learnt[1])},
              "curve": points, "requests": [asdict(r) for r in results]}
    if args.plots_dir:
        report["plot"] = plot(points, Path(args.plots_dir) / "adapt.png")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))
    return 0


def serve_system(args, texts: list[str], adapt: bool, log, limit: int,
                 redis_url: str | None = None) -> tuple[list[Served], tuple[int, dict | None]]:
    """The stream's results, and (the last draft version, its weights) as shared in
    `redis_url` (version 0, None without)."""
    from outrider.client import Client
    from outrider.draft_worker.versions import SharedVersions
    from outrider.local_system import LocalSystemConfig, local_system
    from outrider.state import RedisStore

    cfg = LocalSystemConfig(args.target, args.draft, gamma=args.gamma, grpc_port=0,
                            metrics=True, adapt=adapt, redis_url=redis_url,
                            proposer=args.adapt_proposer)
    with local_system(cfg) as system, Client(system.router, timeout_s=600) as client, \
            DraftWatch(system.metrics["draft-0"]) as watch:
        results = serve_stream(client, watch, texts, args, log, limit)
        if redis_url is None:
            return results, (0, None)
        pair = Path(args.draft).name  # the drafts' default pair name: their model's
        shared = SharedVersions(RedisStore(redis_url, timeout_s=10.0), pair)
        latest = shared.latest()
        return results, (latest, shared.fetch(latest) if latest else None)


def probe_acceptance(args, prompt_ids: list[list[int]], weights: dict | None) -> float:
    """Accepted / drafted over greedy generations of `prompt_ids` in this process, with
    the shipped draft or `weights`."""
    from outrider.core.sampling import SamplingParams
    from outrider.engine.drafter import Drafter
    from outrider.engine.runner import ModelRunner, RunnerConfig
    from outrider.engine.spec_decode import SpeculativeDecoder

    drafter = Drafter(ModelRunner(RunnerConfig(args.draft, kv_cache_mb=128)))
    if weights is not None:
        drafter.adopt(weights)
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(args.target, kv_cache_mb=256)),
                                 drafter)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    seqs = [s for b in range(0, len(prompt_ids), 32)
            for s in decoder.generate(prompt_ids[b:b + 32], params, gamma=args.gamma)]
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    return sum(s.stats.num_accepted_tokens for s in seqs) / drafted if drafted else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.adapt",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
