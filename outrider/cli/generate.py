"""`outrider generate`: one generation, in this process (--local) or through a router."""

from __future__ import annotations

import argparse
import json
import sys

from outrider.cli.common import (
    UsageError,
    add_client_tls_args,
    add_model_args,
    client_tls,
    model_dirs,
)
from outrider.flags import (
    PROPOSERS,
    add_ngram_arg,
    add_self_draft_arg,
    ngram_sizes_of_args,
    tree_shape,
)


def generate_flags(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument("--local", action="store_true",
                     help="run the models in this process instead of calling a router")
    gen.add_argument("--address", default="127.0.0.1:50051", help="router host:port")
    add_client_tls_args(gen)
    gen.add_argument("--timeout", type=float, default=None,
                     help="deadline in seconds (default: none); the API key comes from "
                          "$OUTRIDER_API_KEY")
    gen.add_argument("--speculation", choices=["auto", "off", "fixed"], default=None,
                     help="router mode (default: fixed when --gamma is given, else auto)")
    gen.add_argument("--tag", default="", help="workload tag (acceptance statistics)")
    gen.add_argument("--proposer", choices=PROPOSERS, default=None,
                     help="what proposes draft tokens (auto, model, ngram, suffix; "
                          "docs/DESIGN.md §2.8); default: the replica's (with --local: auto)")
    add_model_args(gen)
    gen.add_argument("--draft-kv-cache-mb", type=float, default=None,
                     help="KV budget of the draft with --local (default: --kv-cache-mb)")
    add_self_draft_arg(gen)
    add_ngram_arg(gen)
    _add_sampling_args(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (token_ids, text, stats) instead of streaming")
    gen.add_argument("--stats", action="store_true", help="print acceptance figures to stderr")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus: sample from the likeliest tokens holding this much "
                        "probability (1: all)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    p.add_argument("--seed", type=int, default=None,
                   help="the same seed gives the same sample (default: a random one)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit per time it was generated")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token generated so far")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="hold EOS and stop tokens back until this many tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[],
                   dest="stop_token_ids", help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each token's logprob and its K likeliest alternatives "
                        "(with --json)")
    constraint = p.add_mutually_exclusive_group()  # structured outputs (docs/API.md)
    constraint.add_argument("--json-schema", metavar="SCHEMA",
                            help="the output is JSON matching this JSON Schema (text, or @FILE)")
    constraint.add_argument("--json-object", action="store_true",
                            help="the output is a JSON object")
    constraint.add_argument("--regex", help="the output matches this regular expression")
    constraint.add_argument("--choice", action="append", default=None,
                            help="the output is one of these strings (repeatable)")
    constraint.add_argument("--grammar", metavar="GRAMMAR",
                            help="the output matches this Lark or GBNF grammar (text, or @FILE)")
    p.add_argument("--whitespace-flexible", action="store_true",
                   help="JSON output may hold any whitespace (default: compact)")


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    result = (_generate_local if args.local else _generate_remote)(args, prompt)
    if args.json:
        print(json.dumps(result.to_dict()))
    if args.stats:
        print(stats_line(result), file=sys.stderr)
    return 0


def _generate_local(args, prompt: str):
    """Decodes in this process and reports it as a router would: the same messages go
    through the SDK's Collector, so --json and --stats read alike either way."""
    from outrider.client.results import Collector
    from outrider.core.sampling import logprobs_to_proto
    from outrider.core.sequence import FinishReason
    from outrider.router.text_stream import TextStream
    from outrider.v1 import generate_pb2 as gp

    params = _sampling_params(args)
    with _local_engine(args) as engine:
        text, collector, sent = TextStream(engine.tokenizer, tuple(args.stop)), Collector(), 0
        for seq, new_ids in engine.decoder.stream(engine.tokenizer.encode(prompt), params,  # noqa: B007
                                                  args.gamma):
            delta = text.push(new_ids)
            if text.is_stopped:
                seq.finish_reason = FinishReason.STOP
                engine.decoder.release(seq)
            elif seq.is_finished:
                delta += text.finish()
            # the tokens the text stream consumed: none past a completed stop string
            ids, logprobs = (seq.output_ids[sent:text.num_tokens],
                             seq.logprobs[sent:text.num_tokens])
            sent = text.num_tokens
            _echo(args, collector.add(gp.GenerateResponse(
                text=delta, token_ids=ids, logprobs=logprobs_to_proto(logprobs))))
            if seq.is_finished:
                break
        _echo(args, collector.add(_final_message(seq, sent)))
    if not args.json:
        sys.stdout.write("\n")
    return collector.result()


def _local_engine(args):
    from outrider.engine.local import LocalEngine, LocalEngineConfig
    from outrider.engine.runner import RunnerConfig

    target, draft = model_dirs(args)
    runner = RunnerConfig(model_dir=str(target), device=args.device, dtype=args.dtype,
                          tp=args.tp, kv_cache_mb=args.kv_cache_mb, compile=args.compile,
                          enforce_eager=args.enforce_eager,
                          memory_utilization=args.gpu_memory_utilization,
                          max_model_len=args.max_model_len, quantization=args.quantization)
    draft_kv = getattr(args, "draft_kv_cache_mb", None) or args.kv_cache_mb
    return LocalEngine(LocalEngineConfig(target=runner, draft_dir=draft if args.gamma else None,
                                         draft_kv_cache_mb=draft_kv,
                                         proposer=args.proposer or "auto",
                                         tree=tree_shape(args),
                                         ngram_sizes=ngram_sizes_of_args(args),
                                         self_draft_layers=args.self_draft_layers
                                         if args.gamma else None))


def _sampling_params(args):
    from outrider.client.request import structured_output
    from outrider.core.sampling import SamplingParams
    from outrider.core.structured import StructuredOutput, StructuredOutputError

    options = _sampling_options(args)
    # SamplingParams (frozen) takes tuples where the SDK takes a dict and a list
    options.update(logit_bias=tuple(sorted(options["logit_bias"].items())),
                   stop_token_ids=tuple(options["stop_token_ids"]))
    try:
        constraint = structured_output(**_constraint_options(args))
        so = StructuredOutput.from_proto(constraint) if constraint is not None else None
    except (StructuredOutputError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return SamplingParams(**options, structured_output=so)


def _constraint_options(args) -> dict:
    """The output constraint flags as the SDK's keyword options (@FILE read)."""
    return dict(json_schema=_text_or_file(args.json_schema), json_object=args.json_object,
                regex=args.regex, choice=args.choice, grammar=_text_or_file(args.grammar),
                whitespace_flexible=args.whitespace_flexible)


def _text_or_file(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:]) as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {value[1:]}: {exc.strerror}") from None


def _sampling_options(args) -> dict:
    """The sampling flags as keyword options (SamplingParams' and the SDK's names)."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                repetition_penalty=args.repetition_penalty,
                frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, logit_bias=_logit_bias(args.logit_bias),
                min_tokens=args.min_tokens, stop_token_ids=args.stop_token_ids,
                ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias wants ID=BIAS, got {pair!r}") from None
    return bias


def _final_message(seq, num_sent: int):
    """What a router's last message would say of a sequence generated in this process."""
    from outrider.v1 import generate_pb2 as gp

    return gp.GenerateResponse(
        finish_reason=seq.finish_reason.value, replica="local",
        usage=gp.Usage(prompt_tokens=seq.prompt_len, completion_tokens=num_sent,
                       cached_prompt_tokens=min(seq.num_cached_tokens or 0, seq.prompt_len)),
        speculation=seq.stats.to_proto())


def _generate_remote(args, prompt: str):
    from outrider.client import Client

    options = dict(_sampling_options(args), stop=args.stop, tag=args.tag,
                   speculation=_speculation_mode(args), gamma_max=args.gamma or 0,
                   proposer=args.proposer or "", **_constraint_options(args))
    with Client(args.address, tls=client_tls(args), timeout_s=args.timeout) as client:
        stream = client.stream(prompt, **options)
        for delta in stream:
            _echo(args, delta)
        result = stream.result()
    if not args.json:
        sys.stdout.write("\n")
    return result


def _speculation_mode(args) -> str:
    if args.speculation:
        return args.speculation
    if args.gamma is None:
        return "auto"
    return "off" if args.gamma == 0 else "fixed"


def _echo(args, delta) -> None:
    if not args.json and delta.text:
        sys.stdout.write(delta.text)
        sys.stdout.flush()


def stats_line(result) -> str:
    """One line of acceptance figures of a Generation (local or through a router)."""
    s, t, n = result.speculation, result.timings, len(result.token_ids)
    per_pos = ", ".join(f"{a / d:.2f}" for a, d in zip(s.accepted_per_position,
                                                        s.drafted_per_position) if d)
    where = f" on {result.replica}" if result.replica != "local" else ""
    return (f"[{n} tokens in {t.total_s:.2f}s = {t.tokens_per_s:.1f} tok/s "
            f"(first after {t.ttft_s * 1000:.0f} ms){where}; rounds {s.rounds}; "
            f"draft tokens {s.draft_tokens}, accepted {s.accepted_tokens} "
            f"(α = {s.acceptance_rate:.3f}; per position: {per_pos or '-'}); "
            f"mean accepted length {s.mean_accepted_len:.2f} tokens/round"
            f"{by_proposer_text(s.by_proposer)}]")


def by_proposer_text(by_proposer: dict[str, tuple[int, int]]) -> str:
    """'; by proposer: draft_model 90/120 (α 0.75), suffix ...' (empty: none)."""
    parts = [f"{method} {kept}/{drafted} (α {kept / drafted:.2f})"
             for method, (drafted, kept) in sorted(by_proposer.items()) if drafted]
    return f"; by proposer: {', '.join(parts)}" if parts else ""
