"""What proposes the draft tokens, side by side with vLLM's n-gram and draft-model
speculation, through ONE load client: vLLM's own `vllm bench serve` (OpenAI HTTP API).

    outrider bench --proposers --vllm VLLM [--rounds 2] [--gamma 4]
        [--out results/proposers.json]
    (or: python -m outrider.bench.proposers --vllm VLLM ...)

Workloads (greedy, EOS ignored, float32; prompts from source files of third-party
packages installed beside Outrider, never in the repository or the demo pair's data):
  copy    copy-heavy, 1 stream, --copy-tokens tokens: code edited in place (a function,
          then the same function begun again under a new name: the model re-emits it)
          and a document then a question whose answer quotes it (a docstring, then
          "Quote it:" and its first words)
  plain   plain code (the first --prompt-tokens tokens of a file), 1, 8 and 32 streams,
          --max-tokens tokens
Systems, each its own server: outrider-KIND is `outrider serve --proposer KIND` (auto,
model, ngram, suffix); vllm-ngram (`method: ngram`, prompt lookup 2..5) and vllm-draft
(`method: draft_model`, --gamma tokens) are `vllm serve`. Servers take turns, the
order reversed on odd rounds; a cell is the mean over rounds (every round kept). The
lookups' own cost is timed in this process over the copy prompts.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from outrider import paths
from outrider.bench import common, servers
from outrider.bench.prompts import package_prompts, package_sources, write_prompts
from outrider.bench.servers import speed_ratio
from outrider.bench.tables import proposers_table

DEFAULT_OUT = "results/proposers.json"
OUTRIDER_KINDS = ("auto", "model", "ngram", "suffix", "lookahead")
PLAIN_LEVELS = (1, 8, 32)


# -- prompts ---------------------------------------------------------------------------------
def edited_in_place(num_prompts: int, max_chars: int = 2400) -> list[str]:
    """A function of 8-40 lines from a package's source, then the same function begun
    again under a new name (its `def` line and first body line)."""
    prompts = []
    for path in package_sources():
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef)
                    and 8 <= node.end_lineno - node.lineno <= 40):
                continue
            text = ast.get_source_segment(source, node, padded=True) or ""
            lines = text.splitlines()
            if len(text) > max_chars or len(lines) < 3:
                continue
            again = "\n".join(lines[:2]).replace(f"def {node.name}(", f"def {node.name}_v2(", 1)
            prompts.append(f"{text}\n\n\n{again}\n")
            break
        if len(prompts) == num_prompts:
            return prompts
    raise RuntimeError(f"found {len(prompts)} functions for {num_prompts} prompts")


def quoted_documents(num_prompts: int, max_chars: int = 1600) -> list[str]:
    """A module docstring, then a request to quote it and its first words."""
    prompts = []
    for path in package_sources():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8",
                                                             errors="replace")))
        except SyntaxError:
            continue
        if not doc or not 300 <= len(doc) <= max_chars:
            continue
        words = doc.split()
        prompts.append(f'"""\n{doc}\n"""\n\n# Quote the text above, word for word:\n'
                       f'# "{" ".join(words[:4])}')
        if len(prompts) == num_prompts:
            return prompts
    raise RuntimeError(f"found {len(prompts)} documents for {num_prompts} prompts")


def copy_prompts(num_prompts: int) -> list[str]:
    half = num_prompts // 2
    return edited_in_place(num_prompts - half) + quoted_documents(half)


# -- the lookups' own cost ---------------------------------------------------------------------
def lookup_cost(tokenizer, prompts: list[str], gamma: int) -> dict:
    """Mean µs per round of each lookup over the prompts' contexts (the suffix corpus
    holding every other prompt), and per context token."""
    import numpy as np

    from outrider.engine.lookup import SuffixCorpus, prompt_lookup, suffix_lookup

    contexts = [np.asarray(tokenizer.encode(p), dtype=np.int64) for p in prompts]
    corpus = SuffixCorpus()
    for c in contexts:
        corpus.add(c.tolist())
    out = {}
    for name, look in (("ngram", lambda c: prompt_lookup(c, gamma)),
                       ("suffix", lambda c: suffix_lookup(c, gamma, corpus))):
        start, calls = time.perf_counter(), 0
        for c in contexts:
            for end in range(16, len(c), 4):  # a round every 4 tokens along the context
                look(c[:end])
                calls += 1
        seconds = (time.perf_counter() - start) / calls
        out[name] = {"us_per_round": round(seconds * 1e6, 1),
                     "mean_context_tokens": round(statistics.fmean(len(c) for c in contexts)),
                     "ns_per_context_token": round(seconds * 1e9 / statistics.fmean(
                         len(c) for c in contexts), 1)}
    return out


# -- one round ---------------------------------------------------------------------------------
def run_round(args, order: list[str], files: dict[str, Path], out_dir: Path, log,
              reverse: bool) -> dict:
    """Every server in `order`; "outrider" is one `outrider serve --proposer KIND` per
    kind (reversed too on odd rounds), as a user would start it: a replica's estimates
    (acceptance per proposer, its cost model) learn from what it serves, so kinds sharing
    one server would be measured on each other's history."""
    results: dict[str, dict[str, dict]] = {}
    for server in order:
        kinds = OUTRIDER_KINDS[::-1] if reverse else OUTRIDER_KINDS
        for system in [f"outrider-{k}" for k in kinds] if server == "outrider" else [server]:
            log(f"{system}: starting")
            with _server(args, system) as url:
                results[system] = measure(args, url, files, out_dir, system, log)
    return results


def _server(args, system: str):
    if system.startswith("outrider-"):
        return servers.base_url(servers.outrider_server(
            args, ("--proposer", system.removeprefix("outrider-"))))
    return servers.base_url(_vllm(args, system))


def _vllm(args, server: str):
    return servers.vllm_server(args, server if server == "vllm-ngram"
                               else servers.vllm_system(True, args.gamma))


def measure(args, url: str, files: dict[str, Path], out_dir: Path, system: str,
            log) -> dict[str, dict]:
    vllm = servers.vllm_command(args.vllm)
    # a warm-up long enough for the replica's online cost model to settle
    servers.bench_serve(vllm, url, args.target, files["warmup"], 4, 16, 64, out_dir,
                        f"warmup-{system}")
    cells = {"copy-c1": servers.cell(servers.bench_serve(
        vllm, url, args.target, files["copy"], 1, args.copy_prompts, args.copy_tokens,
        out_dir, f"{system}-copy"))}
    for c in PLAIN_LEVELS:
        cells[f"plain-c{c}"] = servers.cell(servers.bench_serve(
            vllm, url, args.target, files[f"plain-{c}"], c,
            servers.num_requests(c, args.requests_per_stream), args.max_tokens, out_dir,
            f"{system}-plain"))
    log(f"{system}: " + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s"
                                  for k, v in cells.items()))
    return cells


# -- targets and report ------------------------------------------------------------------------
def targets(results: dict[str, dict[str, dict]]) -> list[dict]:
    auto, model = results["outrider-auto"], results["outrider-model"]
    peers = [results[s]["copy-c1"] for s in ("vllm-ngram", "vllm-draft") if s in results]
    out = []
    if peers:
        best = max(peers, key=lambda x: x["tokens_per_s"])
        out.append(common.target("copy-heavy: auto over vLLM's better of n-gram and draft "
                                 "model", speed_ratio(auto["copy-c1"], best), 1.25,
                                 concurrency=1))
    out.append(common.target("copy-heavy: auto over --proposer model",
                             speed_ratio(auto["copy-c1"], model["copy-c1"]), 1.15,
                             concurrency=1))
    for c in PLAIN_LEVELS:
        out.append(common.target("plain code: auto over --proposer model",
                                 speed_ratio(auto[f"plain-c{c}"], model[f"plain-c{c}"]),
                                 0.97, concurrency=c))
    return out


def add_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    if standalone:
        parser.add_argument("--vllm", required=True,
                            help="vLLM venv, or the command that runs vLLM's CLI")
        parser.add_argument("--target", default=str(paths.demo_target_dir()))
        parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
        parser.add_argument("--max-tokens", type=int, default=96)
        parser.add_argument("--prompt-tokens", type=int, default=128)
        parser.add_argument("--out", default=DEFAULT_OUT)
        servers.add_arguments(parser)
    parser.add_argument("--copy-prompts", type=int, default=16,
                        help="(--proposers) copy-heavy prompts, half code edited in place, "
                             "half quoted documents")
    parser.add_argument("--copy-tokens", type=int, default=128,
                        help="(--proposers) tokens generated per copy-heavy prompt")
    parser.add_argument("--proposer-systems", default="outrider,vllm-ngram,vllm-draft",
                        help="(--proposers) servers to run: outrider (every kind), "
                             "vllm-ngram, vllm-draft")


def run(args) -> int:
    from outrider.core.tokenizer import Tokenizer

    started = common.provenance()  # the commit and date the run began with
    tokenizer = Tokenizer(args.target)
    copy = copy_prompts(args.copy_prompts)
    counts = {c: servers.num_requests(c, args.requests_per_stream) for c in PLAIN_LEVELS}
    plain = package_prompts(tokenizer, 16 + sum(counts.values()), args.prompt_tokens)
    log = lambda text: print(f"[proposers] {text}", file=sys.stderr, flush=True)  # noqa: E731
    order = common.parse_list(args.proposer_systems)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        files = {"warmup": write_prompts(plain[:16], out_dir, "warmup"),
                 "copy": write_prompts(copy, out_dir, "copy")}
        start = 16
        for c, n in counts.items():
            files[f"plain-{c}"] = write_prompts(plain[start:start + n], out_dir,
                                                f"plain-{c}")
            start += n
        rounds = [run_round(args, order[::-1] if r % 2 else order, files, out_dir, log,
                            reverse=bool(r % 2)) for r in range(args.rounds)]
    results = servers.merge_rounds(rounds)
    report = {"provenance": started,
              "machine": common.machine(), "command": common.command_line(),
              "config": {"gamma": args.gamma, "copy_tokens": args.copy_tokens,
                         "copy_prompts": args.copy_prompts, "max_tokens": args.max_tokens,
                         "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                         "vllm_ngram": {**servers.VLLM_NGRAM, "num_speculative_tokens": args.gamma},
                         "client": "vllm bench serve (--backend openai, /v1/completions, "
                                   "--ignore-eos, temperature 0)"},
              "lookup_cost": lookup_cost(tokenizer, copy, 8),
              "results": results, "targets": targets(results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(proposers_table(results))
    print(json.dumps(report["lookup_cost"]))
    common.print_targets(report["targets"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.proposers",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
