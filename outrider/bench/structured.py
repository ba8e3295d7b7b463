"""Structured outputs served (issue 31): validity, speculation's acceptance and throughput,
constrained against unconstrained, Outrider beside vLLM with the draft model, through ONE
client: the official `openai` package over the OpenAI HTTP API.

    outrider bench --structured [--vllm VLLM] [--structured-systems outrider,vllm-draft]
        [--structured-prompts 3] [--document-tokens 48] [--rounds 2] [--gamma 4]
        [--max-tokens 96] [--out results/structured.json]
    (or: python -m outrider.bench.structured ...)

e.g. outrider bench --structured --vllm "../vllm-cpu/bin/python scripts/vllm_cli.py"
(without vLLM: --structured-systems outrider).

Constraints (CONSTRAINTS): three JSON schemas and json_object through chat completions'
`response_format` (json_schema strict); two regexes, two choices and a GBNF grammar
through /v1/completions' `structured_outputs` (vLLM's extra body; Outrider honours it).
Systems, each its own server on the demo pair, one after the other, the order reversed
on odd rounds:
  outrider     `outrider serve`, default settings (AUTO γ)
  vllm-draft   `vllm serve` with the draft model (`method: draft_model`, --gamma tokens)
Per system and round:
  validity     every constraint's prompts, greedy and sampled (T 0.9, fixed seeds),
               --max-tokens tokens, one at a time; every output checked: JSON against its
               schema (SCHEMA_KEYWORDS), a regex matched whole, a choice a member, the
               grammar as an equal Python regex. An output cut by `length` is a prefix and
               is counted apart, not checked
  acceptance   accepted / draft tokens over the same requests, constrained and
               unconstrained (no constraint given; the two passes' order reversed on odd
               rounds): Outrider's usage.speculation (per proposer and per constraint
               too), vLLM's /metrics counters before and after; Outrider's also over the
               prompts whose outputs, constrained or not, do not loop (one short unit
               repeated: is_loop), which is what issue 31's target is judged on
  throughput   the JSON schemas (chat) and the regexes and grammar (completions), 1 and 8
               concurrent streams, greedy, streamed, EOS honoured, in four modes (MODES):
               constrained; matched (unconstrained, each request as long as the constrained
               cell's request of the same constraint and instruction: the same work, so
               tokens/s compares like with like); unconstrained (--max-tokens each); and
               permissive (a regex any text matches: the unconstrained outputs, through the
               grammar machinery) (a finished grammar allows only EOS: with ignore_eos the
               forced EOS tokens would count): output tokens/s, TPOT p50 and the per-token
               rate, 1000 / TPOT p50 ms. The target judges the throughput, constrained
               tokens/s over matched; permissive over unconstrained (per token) is the
               machinery's own cost on the same text. Each pair is measured interleaved,
               slice by slice (PAIRS), so a drift of the machine's speed falls on both.
               Every request here is new to the server: its prompt opens with a document
               of its own (the first --document-tokens tokens of an installed package's
               source file, each level and mode its own, the modes' sets rotated between
               rounds), since Outrider's suffix proposer keeps the replica's finished
               greedy sequences and would replay a repeat
  tool calls   chat requests with TOOLS whose tool_choice forces a call (a named function,
               "required"), greedy and sampled: every call's arguments checked against its
               function's parameters (vLLM serves them only with a tool-call parser:
               VLLM_TOOL_FLAGS)
JSON whitespace is each server's default: Outrider compact, vLLM any (config records it).
Rounds merge as: validity counts summed, acceptance from the summed tokens, throughput the
mean (every round's value kept).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from outrider import paths
from outrider.bench import common, servers
from outrider.bench.prompts import package_prompts
from outrider.bench.tables import STRUCTURED_MODES, ratio, structured_table

DEFAULT_OUT = "results/structured.json"
WARMUP_PROMPTS = {"chat": "Warm up: return anything as JSON.", "completions": "# warm up\n"}
SYSTEMS = ("outrider", "vllm-draft")
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.9}}
SEED = 1000               # sampled request i is seeded SEED + i, constrained or not
LEVELS = (1, 8)
THROUGHPUT_REQUESTS = {1: 24, 8: 48}  # short constrained outputs: cells of ~2 s were noise
# between servers: a stopped server's children (vLLM's engine process) may outlive its
# leader, and `outrider serve` measures its cost model (what AUTO's γ rests on) as it starts
SETTLE_S = 10
SCHEMA_KEYWORDS = ("type", "enum", "required", "properties", "additionalProperties",
                   "items", "maxItems", "maxLength", "minimum", "maximum")
# vLLM's Prometheus counters (their samples are named with `_total`)
VLLM_SPEC_COUNTERS = {"draft_tokens": "vllm:spec_decode_num_draft_tokens",
                      "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


# -- the constraint set ------------------------------------------------------------------------
@dataclass(frozen=True)
class Constraint:
    name: str
    kind: str                  # json_schema, json_object, regex, choice, grammar
    value: object              # the schema, regex, choices or GBNF grammar; None: json_object
    prompts: tuple[str, ...]   # JSON: the user's chat message; the others: the prompt text
    pattern: str = ""          # grammar: a Python regex accepting the same strings

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
TASK = {"type": "object", "additionalProperties": False, "required": ["title", "meta"],
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "meta": {"type": "object", "additionalProperties": False,
                     "required": ["tags", "done"],
                     "properties": {"tags": {"type": "array", "maxItems": 3,
                                             "items": {"type": "string", "enum": [
                                                 "bug", "feature", "docs", "test"]}},
                                    "done": {"type": "boolean"}}}}}
READING = {"type": "object", "additionalProperties": False, "required": ["value"],
           "properties": {"value": {"type": "number", "minimum": -1000, "maximum": 1000},
                          "unit": {"type": "string", "enum": ["m", "s", "kg"]}}}
DATE = r"20\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z][a-z0-9_.]{0,15}@[a-z]{2,12}\.(com|org|net)"
# GBNF (`::=`): vLLM's xgrammar reads it as is, Outrider converts it to Lark
ASSIGNMENT = "\n".join([
    'root ::= name " = " value',
    "name ::= [a-z] [a-z_]? [a-z_]? [a-z_]? [a-z_]? [a-z_]? [a-z_]? [a-z_]?",
    'value ::= digits | "True" | "False" | "None"',
    "digits ::= [0-9] [0-9]? [0-9]? [0-9]?"])
ASSIGNMENT_PATTERN = r"[a-z][a-z_]{0,7} = (\d{1,4}|True|False|None)"

CONSTRAINTS = (
    Constraint("person", "json_schema", PERSON, (
        "Write the user's record as JSON.", "Give one person as a JSON object.",
        "Return a JSON object for the author of this module.")),
    Constraint("task", "json_schema", TASK, (
        "Describe the open issue as JSON.", "Return the task as a JSON object.",
        "Give the ticket as JSON.")),
    Constraint("reading", "json_schema", READING, (
        "Give the sensor reading as JSON.", "Return the measured value as a JSON object.",
        "Report the timing as JSON.")),
    Constraint("object", "json_object", None, (
        "Return the settings as a JSON object.", "Give the package metadata as JSON.",
        "Describe the configuration as a JSON object.")),
    Constraint("date", "regex", DATE, ('released = "', "# Last updated: ", '__date__ = "')),
    Constraint("email", "regex", EMAIL, ('__email__ = "', 'AUTHOR_EMAIL = "', "# Contact: ")),
    Constraint("boolean", "choice", ("True", "False", "None"), (
        "DEBUG = ", "self.verbose = ", "    return ")),
    Constraint("method", "choice", ("GET", "POST", "PUT", "DELETE"), (
        'method = "', 'if request.method == "', 'ALLOWED = ["')),
    Constraint("assignment", "grammar", ASSIGNMENT, (
        "# defaults\n", "class Config:\n    ", "def reset(self):\n    self."),
        pattern=ASSIGNMENT_PATTERN),
)
# the throughput set: the JSON schemas (chat) and the regexes and grammar (completions)
THROUGHPUT_KINDS = ("json_schema", "regex", "grammar")
# throughput modes: the set's constraints; none, each request as long as its constrained
# counterpart (constrained outputs end with their grammar, ~17 tokens here: against --max-tokens
# of the small model's repetitions, which lookups copy whole, tokens/s would compare other
# work); none; and a grammar that allows any text, so its outputs are the unconstrained ones
# and the ratio is the machinery's own cost
MODES = STRUCTURED_MODES  # constrained, matched, unconstrained, permissive
# each mode is judged against its pair's other (targets), so a pair is measured interleaved:
# a slice of one, then the same slice of the other, and so on, and a drift of this shared
# machine's speed (its cells' per-round time swung 50 % within a round) falls on both
# alike. "matched" follows "constrained" in each slice (its lengths); the pairs' order, and
# the second pair's within it, are reversed on odd rounds
PAIRS = (("constrained", "matched"), ("unconstrained", "permissive"))
SLICE_WAVES = 2  # a slice: this many requests per stream (at 1 stream, 12 slices of 2)
PERMISSIVE = r"[\s\S]*"


# tool calls a request forces (chat `tool_choice`), each choice over every TOOL_PROMPTS
# message, greedy and sampled; vLLM takes them only with a tool-call parser (VLLM_TOOL_FLAGS)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}}}}
TOOLS = (WEATHER, CLOCK)
TOOL_CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}},
                "required": "required"}
TOOL_PROMPTS = ("What is the weather in Paris?", "Weather for Oslo, in fahrenheit.",
                "Look up the weather.", "What time is it in Berlin?")
VLLM_TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def items_of(constraints, num_prompts: int) -> list[tuple[Constraint, str]]:
    """(constraint, prompt) pairs: the first `num_prompts` prompts of each constraint."""
    return [(c, p) for c in constraints for p in c.prompts[:num_prompts]]


# -- checking an output ------------------------------------------------------------------------
def is_valid(constraint: Constraint, text: str) -> bool:
    if constraint.is_json:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        schema = constraint.value if constraint.kind == "json_schema" else {"type": "object"}
        return not schema_problems(value, schema)
    if constraint.kind == "choice":
        return text in constraint.value
    pattern = constraint.value if constraint.kind == "regex" else constraint.pattern
    return re.fullmatch(pattern, text) is not None


def schema_problems(value, schema: dict, where: str = "$") -> list[str]:
    """What in `value` breaks `schema`, for the keywords the set uses (SCHEMA_KEYWORDS);
    an unknown keyword is an error here, so a schema added later is never half-checked."""
    unknown = set(schema) - set(SCHEMA_KEYWORDS)
    if unknown:
        raise ValueError(f"the checker does not know {sorted(unknown)}")
    if not has_type(value, schema.get("type")):
        return [f"{where}: not {schema['type']}"]
    problems = []
    if "enum" in schema and not any(same_json(value, e) for e in schema["enum"]):
        problems.append(f"{where}: {value!r} not in the enum")
    if isinstance(value, str) and len(value) > schema.get("maxLength", math.inf):
        problems.append(f"{where}: longer than {schema['maxLength']}")
    if has_type(value, "number") and not (schema.get("minimum", -math.inf) <= value
                                          <= schema.get("maximum", math.inf)):
        problems.append(f"{where}: {value} out of range")
    if isinstance(value, list):
        problems += array_problems(value, schema, where)
    if isinstance(value, dict):
        problems += object_problems(value, schema, where)
    return problems


def has_type(value, name: str | None) -> bool:
    # bool is an int in Python, never in JSON
    if name is None:
        return True
    if name in ("integer", "number"):
        kinds = int if name == "integer" else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool)
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool,
             "null": type(None)}
    return isinstance(value, kinds[name])


def same_json(a, b) -> bool:
    return type(a) is type(b) and a == b


def array_problems(value: list, schema: dict, where: str) -> list[str]:
    problems = ([f"{where}: more than {schema['maxItems']} items"]
                if len(value) > schema.get("maxItems", math.inf) else [])
    for i, item in enumerate(value):
        problems += schema_problems(item, schema.get("items", {}), f"{where}[{i}]")
    return problems


def object_problems(value: dict, schema: dict, where: str) -> list[str]:
    properties = schema.get("properties", {})
    problems = [f"{where}: {k!r} missing" for k in schema.get("required", []) if k not in value]
    if schema.get("additionalProperties", True) is False:
        problems += [f"{where}: {k!r} not allowed" for k in value if k not in properties]
    for key, item in value.items():
        if key in properties:
            problems += schema_problems(item, properties[key], f"{where}.{key}")
    return problems


def verdict(constraint: Constraint, record: dict) -> str:
    """valid / invalid (finished with `stop`), length (cut: a prefix, not checked), error
    (refused or failed), or the finish reason when it is neither stop nor length."""
    if "error" in record:
        return "error"
    if record["finish_reason"] != "stop":
        return record["finish_reason"] or "none"
    return "valid" if is_valid(constraint, record["text"]) else "invalid"


def tool_call_verdict(record: dict) -> str:
    """valid (finished with calls, each a tool's with arguments its parameters take),
    invalid, length (cut before the calls were whole) or error."""
    if "error" in record:
        return "error"
    calls = record["tool_calls"]
    if record["finish_reason"] not in ("stop", "tool_calls"):
        return record["finish_reason"] or "none"
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in calls:
        try:
            value = json.loads(arguments)
        except ValueError:
            return "invalid"
        if name not in by_name or schema_problems(value, by_name[name]):
            return "invalid"
    return "valid" if calls else "invalid"


def count_verdicts(records: list[dict]) -> dict:
    counts = {"total": len(records), "valid": 0, "invalid": 0, "length": 0, "error": 0}
    for r in records:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return counts


# -- requests ----------------------------------------------------------------------------------
def request_of(constraint: Constraint, prompt: str, constrained: bool, max_tokens: int,
               sampling: dict) -> tuple[str, dict]:
    """("chat" | "completions", the openai call's keyword arguments)."""
    body = {"max_tokens": max_tokens, **sampling}
    if constraint.is_json:
        body["messages"] = [{"role": "user", "content": prompt}]
        if constrained:
            body["response_format"] = response_format(constraint)
        return "chat", body
    body["prompt"] = prompt
    if constrained:
        value = list(constraint.value) if constraint.kind == "choice" else constraint.value
        body["extra_body"] = {"structured_outputs": {constraint.kind: value}}
    return "completions", body


def response_format(constraint: Constraint) -> dict:
    if constraint.kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": constraint.name,
                                                   "schema": constraint.value, "strict": True}}


def create(client, endpoint: str):
    return client.chat.completions.create if endpoint == "chat" else client.completions.create


def call(client, endpoint: str, body: dict) -> dict:
    """One request: its text, finish reason and speculation (usage), or its error; a
    refusal is recorded, not raised (a server may not take some constraint)."""
    import openai

    try:
        done = create(client, endpoint)(model=servers.SERVED_NAME, **body)
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    choice = done.choices[0]
    text = (choice.message.content or "") if endpoint == "chat" else choice.text
    spec = (done.usage.model_extra or {}).get("speculation") if done.usage else None
    return {"text": text, "finish_reason": choice.finish_reason,
            "completion_tokens": done.usage.completion_tokens if done.usage else None,
            "speculation": spec and {k: spec.get(k) for k in ("draft_tokens", "accepted_tokens",
                                                              "by_proposer")}}


def stream(client, endpoint: str, body: dict) -> dict:
    """One streamed request: start, end, TTFT (first text), the chunks holding text and
    completion tokens (the usage chunk; the text chunks where a server sends none)."""
    import openai

    start, first, chunks, tokens = time.perf_counter(), None, 0, None
    try:
        for chunk in create(client, endpoint)(model=servers.SERVED_NAME, stream=True,
                                              stream_options={"include_usage": True}, **body):
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk_text(chunk, endpoint):
                first, chunks = first or time.perf_counter(), chunks + 1
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    end = time.perf_counter()
    return {"start": start, "end": end, "ttft": None if first is None else first - start,
            "chunks": chunks, "tokens": chunks if tokens is None else tokens}


def chunk_text(chunk, endpoint: str) -> str:
    choice = chunk.choices[0]
    return (choice.delta.content or "") if endpoint == "chat" else (choice.text or "")


def client_for(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


# -- validity and acceptance -------------------------------------------------------------------
def run_pass(client, items, constrained: bool, sampling: str, max_tokens: int) -> list[dict]:
    """Every (constraint, prompt) once, one at a time; request i of a sampled pass is
    seeded SEED + i, so constrained and unconstrained passes draw alike."""
    records = []
    for i, (constraint, prompt) in enumerate(items):
        seed = {"seed": SEED + i} if sampling != "greedy" else {}
        endpoint, body = request_of(constraint, prompt, constrained, max_tokens,
                                    {**SAMPLINGS[sampling], **seed})
        record = {"constraint": constraint.name, "prompt": prompt, **call(client, endpoint, body)}
        if constrained:
            record["verdict"] = verdict(constraint, record)
        records.append(record)
    return records


def measure_tool_calls(client, max_tokens: int) -> dict:
    """Per tool choice and sampling ("named greedy", ...): the verdicts of its calls."""
    import openai

    out = {}
    for choice_name, choice in TOOL_CHOICES.items():
        for sampling in SAMPLINGS:
            records = []
            for i, prompt in enumerate(TOOL_PROMPTS):
                seed = {"seed": SEED + i} if sampling != "greedy" else {}
                try:
                    done = client.chat.completions.create(
                        model=servers.SERVED_NAME, messages=[{"role": "user", "content": prompt}],
                        max_tokens=max_tokens, tools=list(TOOLS), tool_choice=choice,
                        **SAMPLINGS[sampling], **seed)
                except openai.APIError as e:
                    records.append({"verdict": "error", "error": str(e)[:400]})
                    continue
                first = done.choices[0]
                record = {"finish_reason": first.finish_reason, "tool_calls": [
                    (c.function.name, c.function.arguments)
                    for c in first.message.tool_calls or []]}
                records.append({**record, "verdict": tool_call_verdict(record)})
            out[f"{choice_name} {sampling}"] = count_verdicts(records)
    return out


def spec_counters(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            return parse_counters(reply.read().decode())
    except OSError:
        return None


def parse_counters(text: str) -> dict | None:
    """vLLM's draft and accepted token counters, each summed over its labels; None
    unless both are there."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"{counter}_total": key for key, counter in VLLM_SPEC_COUNTERS.items()}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                key = wanted[sample.name]
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums if len(sums) == len(VLLM_SPEC_COUNTERS) else None


def acceptance(records: list[dict], before: dict | None, after: dict | None) -> dict:
    """accepted / draft tokens: summed from usage.speculation where the server reports
    it (Outrider), else the counters' growth over the pass (vLLM), else unknown."""
    reported = [r for r in records if r.get("speculation")]
    if reported:
        return {**rate_of(*(sum(r["speculation"][k] for r in reported)
                            for k in ("draft_tokens", "accepted_tokens"))),
                "source": "usage.speculation", "by_proposer": by_proposer(reported),
                "by_constraint": by_constraint(reported)}
    if before and after:
        return {**rate_of(*(after[k] - before[k] for k in ("draft_tokens", "accepted_tokens"))),
                "source": "metrics"}
    return {**rate_of(None, None), "source": None}


def rate_of(draft, accepted) -> dict:
    return {"draft_tokens": draft, "accepted_tokens": accepted,
            "rate": accepted / draft if draft else None}


def rates_by(counts: Iterable[tuple[str, int, int]]) -> dict[str, dict]:
    """(key, draft tokens, accepted tokens) summed per key -> each key's rate_of."""
    sums: dict[str, list[int]] = {}
    for key, draft, accepted in counts:
        totals = sums.setdefault(key, [0, 0])
        totals[0], totals[1] = totals[0] + draft, totals[1] + accepted
    return {key: rate_of(*totals) for key, totals in sorted(sums.items())}


def by_proposer(reported: list[dict]) -> dict:
    """Per proposer (grammar, draft_model, ngram, suffix): the grammar's tokens are forced,
    the model drafts inside it and the lookups are cut by it, so their rates tell apart."""
    return rates_by((kind, x["draft_tokens"], x["accepted_tokens"]) for r in reported
                    for kind, x in (r["speculation"].get("by_proposer") or {}).items())


def by_constraint(reported: list[dict]) -> dict:
    """Per constraint, over its prompts (constrained or not): where acceptance goes."""
    return rates_by((r["constraint"], r["speculation"]["draft_tokens"],
                     r["speculation"]["accepted_tokens"]) for r in reported)


def measure_validity(client, url: str, items, max_tokens: int, reverse: bool) -> dict:
    """Per sampling: the constrained pass's verdicts, and acceptance constrained and
    unconstrained (the two passes' order reversed on odd rounds: a replica's AUTO
    estimates learn from what it served before), over every prompt and over the prompts
    whose outputs do not loop (`without_loops`)."""
    out = {"validity": {}, "acceptance": {}, "outputs": []}
    for sampling in SAMPLINGS:
        out["acceptance"][sampling], passes = {}, {}
        for constrained in (False, True) if reverse else (True, False):
            before = spec_counters(url)
            records = run_pass(client, items, constrained, sampling, max_tokens)
            time.sleep(1)  # vLLM records a step's counters after it answers
            mode = "constrained" if constrained else "unconstrained"
            out["acceptance"][sampling][mode] = acceptance(records, before, spec_counters(url))
            passes[mode] = records
            if constrained:
                out["validity"][sampling] = count_verdicts(records)
                out["outputs"] += [{"sampling": sampling, **r} for r in records]
        looping = looping_prompts(passes.values())
        for mode, records in passes.items():
            out["acceptance"][sampling][mode]["without_loops"] = acceptance(
                [r for r in records if prompt_of(r) not in looping], None, None)
    return out


LOOP_UNIT_CHARS = 4   # an output that is one unit this short, repeated ...
LOOP_MIN_CHARS = 16   # ... over at least this many characters, is a loop, not text


def is_loop(text: str) -> bool:
    """One unit of at most LOOP_UNIT_CHARS characters repeated (the last maybe cut) over
    LOOP_MIN_CHARS or more: the demo target's greedy reply to every chat prompt given no
    constraint is "\n#" 48 times, which any proposer predicts whole (acceptance 1.0)."""
    return len(text) >= LOOP_MIN_CHARS and any(
        text == (text[:n] * (len(text) // n + 1))[:len(text)]
        for n in range(1, LOOP_UNIT_CHARS + 1))


def looping_prompts(passes: Iterable[list[dict]]) -> set[tuple[str, str]]:
    """(constraint, prompt) of the outputs that loop in any of the passes: they leave
    every pass, the same prompts on both sides. Against a loop no constrained output can
    do better, and it tells nothing of speculation under a grammar."""
    return {prompt_of(r) for records in passes for r in records
            if is_loop(r.get("text") or "")}


def prompt_of(record: dict) -> tuple[str, str]:
    """(constraint, prompt): a request the same on both passes, constrained or not."""
    return record["constraint"], record["prompt"]


# -- throughput --------------------------------------------------------------------------------
def throughput_items(documents: list[str]) -> list[tuple[Constraint, str]]:
    """One request per document: the throughput set's constraints in turn, each prompt
    the document and then the constraint's own prompt (the chat message's instruction)."""
    chosen = [c for c in CONSTRAINTS if c.kind in THROUGHPUT_KINDS]
    items = []
    for i, document in enumerate(documents):
        c = chosen[i % len(chosen)]
        prompt = c.prompts[i // len(chosen) % len(c.prompts)]
        items.append((c, f"{document}\n\n{prompt}" if c.is_json else f"{document}\n{prompt}"))
    return items


def pair_orders(reverse: bool) -> list[tuple[str, str]]:
    """PAIRS in order, or reversed with the second pair's modes swapped (not the first's:
    matched needs its constrained slice's lengths)."""
    return [PAIRS[1][::-1], PAIRS[0]] if reverse else list(PAIRS)


def measure_pair(client, items: dict[str, list], level: int, pair: tuple[str, str],
                 max_tokens: int) -> dict[str, dict]:
    """Both modes' cells, interleaved by slices of SLICE_WAVES * level requests (PAIRS):
    each mode's seconds are its slices' wall times; matched request i at most as long as
    constrained request i."""
    size = SLICE_WAVES * level
    records: dict[str, list[dict]] = {mode: [] for mode in pair}
    seconds = dict.fromkeys(pair, 0.0)
    for begin in range(0, max(len(items[mode]) for mode in pair), size):
        for mode in pair:
            lengths = ([r.get("tokens") for r in records["constrained"][begin:begin + size]]
                       if mode == "matched" else None)
            requests = requests_of(items[mode][begin:begin + size], mode, max_tokens, lengths)
            start = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                records[mode] += pool.map(lambda r: stream(client, *r), requests)
            seconds[mode] += time.perf_counter() - start
    return {mode: summarize(records[mode], seconds[mode]) for mode in pair}


def requests_of(items, mode: str, max_tokens: int,
                lengths: list[int | None] | None = None) -> list[tuple[str, dict]]:
    """The items' greedy requests in a MODES mode; request i at most lengths[i] tokens
    where given (an errored one's: max_tokens)."""
    caps = ([max_tokens if n is None else max(n, 1) for n in lengths] if lengths
            else [max_tokens] * len(items))
    requests = [request_of(c, p, mode == "constrained", cap, SAMPLINGS["greedy"])
                for (c, p), cap in zip(items, caps)]
    if mode == "permissive":  # any text: the same tokens as unconstrained, through the mask
        for _, body in requests:
            body["extra_body"] = {"structured_outputs": {"regex": PERMISSIVE}}
    return requests


def summarize(records: list[dict], wall_s: float) -> dict:
    done = [r for r in records if "error" not in r]
    tokens = sum(r["tokens"] for r in done)
    tpots = [(r["end"] - r["start"] - r["ttft"]) / (r["tokens"] - 1) for r in done
             if r["ttft"] is not None and r["tokens"] > 1]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    tpot = statistics.median(tpots) if tpots else None
    chunks = sum(r["chunks"] for r in done)
    return {"requests": len(records), "errors": len(records) - len(done),
            "completion_tokens": tokens, "mean_tokens": tokens / len(done) if done else None,
            "seconds": wall_s, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
            "tpot_ms_p50": None if tpot is None else 1e3 * tpot,
            "per_token_rate": 1 / tpot if tpot else None,
            # a server that sends its tokens in a few bursts makes TTFT ~ the whole request
            # and TPOT ~ 0: tokens per chunk shows it
            "tokens_per_chunk": tokens / chunks if chunks else None,
            "first_error": next((r["error"] for r in records if "error" in r), None),
            "output_tokens": [r.get("tokens") for r in records]}


# a cell's entries that are no figure to average over rounds
UNMERGED = ("first_error", "output_tokens")


def measure_throughput(client, items: dict[str, dict[int, list]], max_tokens: int,
                       reverse: bool) -> dict:
    """Per level, every mode on its own items, each pair interleaved (PAIRS; the orders
    reversed on odd rounds); matched requests as long as the constrained ones."""
    out = {}
    for level in LEVELS:
        cells = out[f"c{level}"] = {}
        for pair in pair_orders(reverse):
            cells.update(measure_pair(client, {mode: items[mode][level] for mode in pair},
                                      level, pair, max_tokens))
    return out


# -- one round ---------------------------------------------------------------------------------
def run_round(args, order: list[str], documents: dict[str, dict[int, list[str]]], log,
              reverse: bool) -> dict[str, dict]:
    results = {}
    for system in order:
        log(f"{system}: starting")
        with server(args, system) as url:
            results[system] = measure(args, url, system, documents, log, reverse)
        time.sleep(SETTLE_S)
    return results


def server(args, system: str):
    if system == "outrider":
        return servers.base_url(servers.outrider_server(args))
    return servers.base_url(servers.vllm_server(args, servers.vllm_system(True, args.gamma),
                                                extra=VLLM_TOOL_FLAGS))


def measure(args, url: str, system: str, documents: dict[str, dict[int, list[str]]], log,
            reverse: bool) -> dict:
    client = client_for(url)
    items = items_of(CONSTRAINTS, args.structured_prompts)
    warm_up(client)
    out = measure_validity(client, url, items, args.max_tokens, reverse)
    log(f"{system}: validity {out['validity']}, acceptance "
        + ", ".join(f"{s} {a['constrained']['rate']} / {a['unconstrained']['rate']}"
                    for s, a in out["acceptance"].items()))
    items = {mode: {level: throughput_items(docs) for level, docs in by_level.items()}
             for mode, by_level in documents.items()}
    out["throughput"] = measure_throughput(client, items, args.max_tokens, reverse)
    out["tool_calls"] = measure_tool_calls(client, args.max_tokens)
    log(f"{system}: tool calls {out['tool_calls']}")
    log(f"{system}: throughput " + ", ".join(
        f"{level} {mode} {cell['tokens_per_s']:.0f} tok/s {cell['per_token_rate'] or 0:.0f}/s"
        for level, cells in out["throughput"].items() for mode, cell in cells.items()))
    return out


def warm_up(client) -> None:
    """Each constraint once, short, and one unconstrained request per endpoint: compiling
    and the first requests' one-off costs stay out of the figures. Its prompts are no
    measured request's (the suffix proposer would find their outputs)."""
    for constraint in CONSTRAINTS:
        call(client, *warm_up_request(constraint, True))
    for constraint in (CONSTRAINTS[0], CONSTRAINTS[4]):  # chat, then completions
        call(client, *warm_up_request(constraint, False))


def warm_up_request(constraint: Constraint, constrained: bool) -> tuple[str, dict]:
    prompt = WARMUP_PROMPTS["chat" if constraint.is_json else "completions"]
    return request_of(constraint, prompt, constrained, 16, SAMPLINGS["greedy"])


# -- rounds merged, targets, report ------------------------------------------------------------
def merge_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    return {system: {"validity": merge_validity([r[system]["validity"] for r in rounds]),
                     "acceptance": merge_acceptance([r[system]["acceptance"] for r in rounds]),
                     "throughput": merge_throughput([r[system]["throughput"] for r in rounds]),
                     "tool_calls": merge_validity([r[system]["tool_calls"] for r in rounds])}
            for system in rounds[0]}


def merge_validity(rounds: list[dict]) -> dict:
    """Counts summed over rounds (every round's kept)."""
    merged = {}
    for sampling in rounds[0]:
        keys = {k for r in rounds for k in r[sampling]}
        merged[sampling] = {k: sum(r[sampling].get(k, 0) for r in rounds) for k in sorted(keys)}
        merged[sampling]["rounds"] = [r[sampling] for r in rounds]
    return merged


def merge_acceptance(rounds: list[dict]) -> dict:
    return {sampling: {mode: merge_acceptance_cells([r[sampling][mode] for r in rounds])
                       for mode in modes}
            for sampling, modes in rounds[0].items()}


def merge_acceptance_cells(cells: list[dict]) -> dict:
    """Accepted / draft over every round's tokens (each round's rate kept); unknown if
    any round's is."""
    known = all(c["draft_tokens"] is not None for c in cells)
    draft = sum(c["draft_tokens"] for c in cells) if known else None
    accepted = sum(c["accepted_tokens"] for c in cells) if known else None
    merged = {**rate_of(draft, accepted), "rate_rounds": [c["rate"] for c in cells],
              "source": cells[0]["source"]}
    for field in ("by_proposer", "by_constraint"):
        if all(field in c for c in cells):
            merged[field] = rates_by((key, x["draft_tokens"], x["accepted_tokens"])
                                     for c in cells for key, x in c[field].items())
    if all("without_loops" in c for c in cells):
        merged["without_loops"] = merge_acceptance_cells([c["without_loops"] for c in cells])
    return merged


def merge_throughput(rounds: list[dict]) -> dict:
    """Each figure's mean over rounds; tokens/s and the per-token rate per round too."""
    merged = {}
    for level, modes in rounds[0].items():
        merged[level] = {}
        for mode in modes:
            cells = [r[level][mode] for r in rounds]
            merged[level][mode] = {k: mean_or_none([c[k] for c in cells])
                                   for k in cells[0] if k not in UNMERGED}
            for k in ("tokens_per_s", "per_token_rate"):
                merged[level][mode][f"{k}_rounds"] = [c[k] for c in cells]
    return merged


def mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def targets(results: dict[str, dict]) -> list[dict]:
    """Issue 31's, for Outrider: no invalid finished output; acceptance constrained ≥
    unconstrained on the prompts whose outputs do not loop; at 1 and 8 streams
    the constrained throughput ≥ 0.9x the same requests' unconstrained (matched
    lengths), and the machinery's own cost (permissive per token)."""
    outrider = results.get("outrider")
    if outrider is None:
        return []
    invalid = sum(v["invalid"] for v in outrider["validity"].values())
    out = [common.target("Outrider: invalid outputs among finished (stop) ones", invalid, 0,
                         higher_is_better=False),
           common.target("Outrider: invalid tool calls among finished ones",
                         sum(v["invalid"] for v in outrider["tool_calls"].values()), 0,
                         higher_is_better=False)]
    for sampling, modes in outrider["acceptance"].items():
        con, unc = (modes[m]["without_loops"] for m in ("constrained", "unconstrained"))
        out.append(common.target(f"Outrider {sampling}: acceptance constrained over "
                                 "unconstrained, prompts whose outputs do not loop",
                                 ratio(con["rate"], unc["rate"]), 1.0))
    for level in LEVELS:
        cells = outrider["throughput"][f"c{level}"]
        out += [common.target(
                    "Outrider: constrained throughput (tok/s) over unconstrained of the same "
                    "lengths", ratio(cells["constrained"]["tokens_per_s"],
                                     cells["matched"]["tokens_per_s"]), 0.9, concurrency=level),
                common.target(
                    "Outrider: permissive per-token rate (1/TPOT p50) over unconstrained",
                    ratio(cells["permissive"]["per_token_rate"],
                          cells["unconstrained"]["per_token_rate"]), 0.9, concurrency=level)]
    return out


# (mode, its baseline): constrained against the same work unconstrained and against
# --max-tokens outputs; the machinery's cost on the same text
RATIOS = (("constrained", "matched"), ("constrained", "unconstrained"),
          ("permissive", "unconstrained"))


def comparison(results: dict[str, dict]) -> dict:
    """Each mode over its baseline per system (RATIOS), and Outrider over vLLM where both
    ran."""
    out = {f"{mode}_over_{base}": {
        s: {level: {k: ratio(cells[mode][k], cells[base][k])
                    for k in ("tokens_per_s", "per_token_rate")}
            for level, cells in r["throughput"].items()} for s, r in results.items()}
        for mode, base in RATIOS}
    if "outrider" in results and "vllm-draft" in results:
        ours, theirs = results["outrider"]["throughput"], results["vllm-draft"]["throughput"]
        out["outrider_over_vllm"] = {
            level: {mode: {k: ratio(ours[level][mode][k], theirs[level][mode][k])
                           for k in ("tokens_per_s", "per_token_rate")} for mode in cells}
            for level, cells in ours.items()}
    return out


# -- command line ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    if standalone:
        parser.add_argument("--vllm", help="vLLM venv, or the command that runs vLLM's CLI")
        parser.add_argument("--target", default=str(paths.demo_target_dir()))
        parser.add_argument("--draft", default=str(paths.demo_draft_dir()))
        parser.add_argument("--max-tokens", type=int, default=96)
        parser.add_argument("--out", default=DEFAULT_OUT)
        servers.add_arguments(parser)
    parser.add_argument("--structured-systems", default=",".join(SYSTEMS),
                        help="(--structured) servers to run: outrider, vllm-draft (needs "
                             "--vllm)")
    parser.add_argument("--structured-prompts", type=int, default=3,
                        help="(--structured) prompts per constraint (at most 3)")
    parser.add_argument("--document-tokens", type=int, default=48,
                        help="(--structured) throughput: tokens of source text opening each "
                             "prompt")


def chosen_systems(args) -> list[str]:
    systems = common.parse_list(args.structured_systems)
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        raise SystemExit(f"--structured-systems: choose from {', '.join(SYSTEMS)}, "
                         f"got {args.structured_systems!r}")
    if "vllm-draft" in systems and not args.vllm:
        raise SystemExit("vllm-draft needs --vllm (or --structured-systems outrider)")
    return systems


def config_of(args, systems: list[str]) -> dict:
    return {"systems": systems, "rounds": args.rounds, "gamma": args.gamma,
            "dtype": args.dtype, "max_tokens": args.max_tokens,
            "prompts_per_constraint": args.structured_prompts, "samplings": SAMPLINGS,
            "seed": f"sampled request i: {SEED} + i", "levels": list(LEVELS),
            "throughput_requests": THROUGHPUT_REQUESTS,
            "document_tokens": args.document_tokens,
            "constraints": [{"name": c.name, "kind": c.kind, "value": c.value,
                             "prompts": list(c.prompts[:args.structured_prompts])}
                            for c in CONSTRAINTS],
            "throughput_kinds": list(THROUGHPUT_KINDS),
            "client": "openai package: JSON via chat completions response_format, the others "
                      "via /v1/completions extra_body structured_outputs; throughput streamed "
                      "with include_usage, greedy, EOS honoured",
            "json_whitespace": "each server's default (Outrider: compact; vLLM: any)",
            "tool_calls": {"tools": list(TOOLS), "tool_choices": TOOL_CHOICES,
                           "prompts": list(TOOL_PROMPTS), "vllm_flags": list(VLLM_TOOL_FLAGS)}}


def cell_documents(target: str, tokens: int) -> list[dict[int, list[str]]]:
    """len(MODES) sets of THROUGHPUT_REQUESTS documents per level, none used twice (files
    opening alike, e.g. with one licence header, are one document: the first). Each mode
    takes its own set: the same prompt twice gives the same output, which the second time
    the suffix proposer would replay from the replica's corpus."""
    from outrider.core.tokenizer import Tokenizer

    needed = sum(THROUGHPUT_REQUESTS.values()) * len(MODES)
    texts = list(dict.fromkeys(package_prompts(Tokenizer(target), 4 * needed, tokens)))
    if len(texts) < needed:
        raise RuntimeError(f"found {len(texts)} distinct documents for {needed} requests")
    sets = []
    for _ in MODES:
        out = {}
        for level, count in THROUGHPUT_REQUESTS.items():
            out[level], texts = texts[:count], texts[count:]
        sets.append(out)
    return sets


def rotated_documents(sets: list[dict], round_index: int) -> dict[str, dict[int, list[str]]]:
    """Mode -> its documents this round: the sets rotate between rounds, so no mode keeps
    the easier documents."""
    return {mode: sets[(i + round_index) % len(sets)] for i, mode in enumerate(MODES)}


def run(args) -> int:
    started = common.provenance()  # the commit and date the run began with
    systems = chosen_systems(args)
    log = lambda text: print(f"[structured] {text}", file=sys.stderr, flush=True)  # noqa: E731
    sets = cell_documents(args.target, args.document_tokens)
    rounds = [run_round(args, systems[::-1] if r % 2 else systems, rotated_documents(sets, r),
                        log, reverse=bool(r % 2)) for r in range(args.rounds)]
    results = merge_rounds(rounds)
    report = {"provenance": started,
              "machine": common.machine(), "command": common.command_line(),
              "config": {**config_of(args, systems), "distinct_documents": len(
                  {d for docs in sets for ds in docs.values() for d in ds})},
              "rounds": rounds, "results": results, "comparison": comparison(results),
              "targets": targets(results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(structured_table(results, [c.name for c in CONSTRAINTS]))
    print(json.dumps(report["comparison"]))
    common.print_targets(report["targets"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outrider.bench.structured",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
