"""The structured-outputs benchmark's pure parts (outrider.bench.structured): the output
checkers, the constraint set compiling with Outrider's own checker, requests built per
endpoint, vLLM's counters read, rounds merged, targets judged, and the `outrider bench
--structured` flag. No server and no vLLM runs here."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from outrider import paths
from outrider.bench import structured
from outrider.bench.structured import CONSTRAINTS, PERSON, READING, TASK, Constraint
from outrider.bench.tables import structured_table
from outrider.cli import build_parser
from outrider.cli.bench import _chosen_benchmark
from outrider.core.grammar import Grammars
from outrider.core.structured import StructuredOutput
from outrider.core.tokenizer import Tokenizer

BY_NAME = {c.name: c for c in CONSTRAINTS}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(str(paths.demo_target_dir()))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer.path, tokenizer.vocab_size, [0])


def table_of(results: dict) -> str:
    """The tables as the run prints them: constraints in the set's order."""
    return structured_table(results, [c.name for c in CONSTRAINTS])


def structured_output(c: Constraint) -> StructuredOutput:
    value = {"json_schema": json.dumps(c.value), "choice": tuple(c.value or ()),
             "json_object": ""}.get(c.kind, c.value)
    return StructuredOutput(c.kind, value)


# -- the checkers ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [{"name": "bob", "age": 30}, {"name": "", "age": 0},
                                   {"name": "x" * 16, "age": 120}])
def test_the_schema_checker_accepts_what_the_schema_allows(value):
    assert structured.schema_problems(value, PERSON) == []


@pytest.mark.parametrize("value,words", [
    ({"name": "bob"}, "'age' missing"),
    ({"name": "bob", "age": 3, "email": "b@x"}, "'email' not allowed"),
    ({"name": "bob", "age": True}, "$.age: not integer"),       # a bool is no integer
    ({"name": "bob", "age": 3.5}, "$.age: not integer"),
    ({"name": "bob", "age": 121}, "out of range"),
    ({"name": "bob", "age": -1}, "out of range"),
    ({"name": "x" * 17, "age": 1}, "longer than 16"),
    (["bob", 30], "$: not object"),
])
def test_the_schema_checker_names_what_breaks_it(value, words):
    problems = structured.schema_problems(value, PERSON)
    assert any(words in p for p in problems), problems


def test_nested_objects_arrays_enums_and_optional_fields_are_checked():
    good = {"title": "fix", "meta": {"tags": ["bug", "docs"], "done": False}}
    assert structured.schema_problems(good, TASK) == []
    too_many = {"title": "fix", "meta": {"tags": ["bug"] * 4, "done": False}}
    assert structured.schema_problems(too_many, TASK) == ["$.meta.tags: more than 3 items"]
    bad_tag = {"title": "fix", "meta": {"tags": ["bug", "wat"], "done": 1}}
    assert structured.schema_problems(bad_tag, TASK) == [
        "$.meta.tags[1]: 'wat' not in the enum", "$.meta.done: not boolean"]
    assert structured.schema_problems({"value": 3}, READING) == []        # unit optional
    assert structured.schema_problems({"value": -2.5, "unit": "kg"}, READING) == []
    assert structured.schema_problems({"value": 1e4, "unit": "m"}, READING)
    assert structured.schema_problems({"value": 1, "unit": "ft"}, READING)
    with pytest.raises(ValueError, match="pattern"):   # never a half-checked schema
        structured.schema_problems("a", {"type": "string", "pattern": "a"})


def test_outputs_are_checked_by_their_kind():
    valid = structured.is_valid
    assert valid(BY_NAME["person"], '{"name":"a","age":1}')
    assert not valid(BY_NAME["person"], '{"name":"a","age":1')        # not JSON
    assert valid(BY_NAME["object"], "{}") and not valid(BY_NAME["object"], "[]")
    assert valid(BY_NAME["date"], "2024-02-29")
    assert not valid(BY_NAME["date"], "2024-13-01") and not valid(BY_NAME["date"], "2024-02-29x")
    assert valid(BY_NAME["email"], "a.b_c@site.org") and not valid(BY_NAME["email"], "a@b.io")
    assert valid(BY_NAME["method"], "PUT") and not valid(BY_NAME["method"], "PUTS")
    assert valid(BY_NAME["assignment"], "max_len = 512")
    assert not valid(BY_NAME["assignment"], "x = 12345")


def test_a_verdict_counts_only_finished_outputs_as_valid_or_invalid():
    person = BY_NAME["person"]
    assert structured.verdict(person, {"text": "{", "finish_reason": "length"}) == "length"
    assert structured.verdict(person, {"text": "{", "finish_reason": "stop"}) == "invalid"
    assert structured.verdict(person, {"error": "BadRequestError: no"}) == "error"
    records = [{"verdict": v} for v in ("valid", "valid", "invalid", "length", "error")]
    assert structured.count_verdicts(records) == {"total": 5, "valid": 2, "invalid": 1,
                                                  "length": 1, "error": 1}


# -- the constraint set ------------------------------------------------------------------------
def test_every_constraint_compiles_with_outriders_checker(grammars):
    assert {c.kind for c in CONSTRAINTS} == {"json_schema", "json_object", "regex", "choice",
                                             "grammar"}
    for c in CONSTRAINTS:
        grammars.check(structured_output(c))
        assert len(c.prompts) == 3


def test_the_grammars_python_regex_accepts_what_the_grammar_does(tokenizer, grammars):
    so = structured_output(BY_NAME["assignment"])
    assert "::=" in so.value   # GBNF, converted by Outrider as vLLM reads it natively
    for text in ("abc = 12", "a = True", "abcdefgh = 1234", "ab_c = None", "abcdefghi = 1",
                 "x = 12345", "A = 1", "x = 1x", "x= 1"):
        matcher = LLMatcher(grammars.tokenizer, so.grammar, log_level=0)
        grammar_says = (matcher.consume_tokens(tokenizer.encode(text))
                        and matcher.is_accepting() and not matcher.is_error())
        assert bool(grammar_says) == structured.is_valid(BY_NAME["assignment"], text), text


def test_requests_go_to_their_endpoint_with_or_without_the_constraint():
    greedy = {"temperature": 0.0}
    endpoint, body = structured.request_of(BY_NAME["task"], "p", True, 96, greedy)
    assert endpoint == "chat" and body["messages"] == [{"role": "user", "content": "p"}]
    assert body["response_format"]["json_schema"] == {"name": "task", "schema": TASK,
                                                      "strict": True}
    _, body = structured.request_of(BY_NAME["object"], "p", True, 96, greedy)
    assert body["response_format"] == {"type": "json_object"}
    endpoint, body = structured.request_of(BY_NAME["method"], "p", True, 96, greedy)
    assert endpoint == "completions" and body["prompt"] == "p"
    assert body["extra_body"] == {"structured_outputs": {"choice": ["GET", "POST", "PUT",
                                                                    "DELETE"]}}
    for c in CONSTRAINTS:   # unconstrained: the same request, no constraint
        _, body = structured.request_of(c, "p", False, 96, greedy)
        assert "response_format" not in body and "extra_body" not in body
        assert body["max_tokens"] == 96 and body["temperature"] == 0.0
    items = structured.items_of(CONSTRAINTS, 2)
    assert len(items) == 2 * len(CONSTRAINTS) and items[1] == (CONSTRAINTS[0],
                                                               CONSTRAINTS[0].prompts[1])


def test_throughput_requests_are_new_to_the_server_and_warm_up_is_no_measured_request():
    sets = structured.cell_documents(str(paths.demo_target_dir()), 24)
    assert len(sets) == len(structured.MODES)
    assert all({level: len(d) for level, d in docs.items()} == structured.THROUGHPUT_REQUESTS
               for docs in sets)
    every = [d for docs in sets for ds in docs.values() for d in ds]
    assert len(set(every)) == len(every)             # no level or mode repeats another's
    first_round, second_round = (structured.rotated_documents(sets, r) for r in (0, 1))
    assert [first_round[m] for m in structured.MODES] == sets       # each mode its own set,
    assert all(second_round[m] != first_round[m] for m in structured.MODES)  # another later
    documents = first_round["constrained"]
    items = structured.throughput_items(documents[8])
    assert len({p for _, p in items}) == len(items) == structured.THROUGHPUT_REQUESTS[8]
    assert {c.kind for c, _ in items} == set(structured.THROUGHPUT_KINDS)
    first, prompt = items[0]
    assert first.name == "person" and prompt == f"{documents[8][0]}\n\n{first.prompts[0]}"
    measured = {p for c in CONSTRAINTS for p in c.prompts} | {p for _, p in items}
    assert not measured & set(structured.WARMUP_PROMPTS.values())


def test_a_tool_call_is_valid_when_its_arguments_keep_to_its_function():
    weather = ("get_weather", '{"city":"Oslo","unit":"c"}')
    verdict = structured.tool_call_verdict
    assert verdict({"finish_reason": "stop", "tool_calls": [weather]}) == "valid"
    assert verdict({"finish_reason": "tool_calls",
                    "tool_calls": [weather, ("get_time", '{"zone":"utc"}')]}) == "valid"
    for calls in ([("get_weather", '{"city":"Oslo"}')],              # a required key missing
                  [("get_weather", '{"city":"Oslo","unit":"k"}')],  # outside the enum
                  [("get_weather", '"b.g.g"')],                     # not an object
                  [("get_weather", '{"city":')],                    # not JSON
                  [("get_date", '{}')],                             # no such tool
                  []):                                              # no call at all
        assert verdict({"finish_reason": "stop", "tool_calls": calls}) == "invalid", calls
    assert verdict({"finish_reason": "length", "tool_calls": [("get_weather", '{"ci')]}) \
        == "length"
    assert verdict({"error": "BadRequestError"}) == "error"


# -- acceptance and throughput figures ---------------------------------------------------------
VLLM_METRICS = """# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="demo-target"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="demo-target"} 8.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="demo-target"} 64.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 40.0
"""


def test_vllms_counters_are_read_and_acceptance_taken_from_usage_or_them():
    assert structured.parse_counters(VLLM_METRICS) == {"draft_tokens": 128.0,
                                                       "accepted_tokens": 64.0}
    assert structured.parse_counters("vllm:num_requests_running 0\n") is None
    usage = [{"constraint": "date", "speculation": {"draft_tokens": 10, "accepted_tokens": 7}},
             {"constraint": "date", "speculation": {"draft_tokens": 10, "accepted_tokens": 5}},
             {"constraint": "date", "error": "x"}]
    assert structured.acceptance(usage, None, None)["rate"] == pytest.approx(0.6)
    before, after = {"draft_tokens": 100, "accepted_tokens": 50}, {"draft_tokens": 140,
                                                                     "accepted_tokens": 80}
    counted = structured.acceptance([{"speculation": None}], before, after)
    assert counted["rate"] == pytest.approx(0.75) and counted["source"] == "metrics"
    assert structured.acceptance([{}], None, None)["rate"] is None
    split = [{"constraint": "date",
              "speculation": {"draft_tokens": 12, "accepted_tokens": 6, "by_proposer": {
                 "draft_model": {"draft_tokens": 8, "accepted_tokens": 6},
                 "suffix": {"draft_tokens": 4, "accepted_tokens": 0}}}},
             {"constraint": "date",
              "speculation": {"draft_tokens": 8, "accepted_tokens": 2, "by_proposer": {
                 "draft_model": {"draft_tokens": 8, "accepted_tokens": 2}}}}]
    kinds = structured.acceptance(split, None, None)["by_proposer"]
    assert kinds["draft_model"]["rate"] == pytest.approx(0.5) and kinds["suffix"]["rate"] == 0


def test_acceptance_per_constraint_is_summed_over_rounds_and_tabled_beside_unconstrained():
    """Which constraints' prompts the grammar helps: each constraint's tokens summed over
    its prompts, then over rounds, constrained beside the same prompts unconstrained."""
    def record(name, drafted, kept):
        return {"constraint": name,
                "speculation": {"draft_tokens": drafted, "accepted_tokens": kept}}

    constrained = structured.acceptance([record("person", 10, 9), record("person", 10, 7),
                                         record("date", 4, 1), {"constraint": "date"}],
                                        None, None)
    assert constrained["by_constraint"]["person"] == {"draft_tokens": 20,
                                                      "accepted_tokens": 16, "rate": 0.8}
    assert constrained["by_constraint"]["date"]["rate"] == 0.25
    unconstrained = structured.acceptance([record("person", 30, 15), record("date", 8, 4)],
                                          None, None)
    rounds = [{"outrider": {**system_round(0, (0.7, 0.6), (200, 210)),
                            "acceptance": {"greedy": {"constrained": constrained,
                                                      "unconstrained": unconstrained}}}}] * 2
    merged = structured.merge_rounds(rounds)
    person = merged["outrider"]["acceptance"]["greedy"]["constrained"]["by_constraint"]["person"]
    assert person == {"draft_tokens": 40, "accepted_tokens": 32, "rate": 0.8}
    table = table_of(merged)
    assert "| outrider | greedy | person | 40 | 0.800 | 0.500 | 1.60 |" in table
    assert "| outrider | greedy | date | 8 | 0.250 | 0.500 | 0.50 |" in table
    assert table.index("| person |") < table.index("| date |")   # the set's order


@pytest.mark.parametrize("text, loops", [
    ("\n#" * 48, True), ("#\n" * 40, True), ("x" * 16, True), ("abc" * 6 + "a", True),
    ("ab" * 7, False), ("", False),                       # too short to tell
    ("abcde" * 4, False),                                # a unit of 5: not short
    ("True", False), ('{"name":"Ada","age":36}', False),
    ("The module is used. The module is used. ", False),  # a unit longer than 4
])
def test_a_loop_is_one_short_unit_repeated(text, loops):
    assert structured.is_loop(text) is loops


def test_acceptance_without_loops_leaves_out_the_prompts_that_loop_on_either_side():
    """The same prompts on both sides: a prompt whose output loops constrained or
    unconstrained leaves both passes; the rest are counted as usual."""
    def record(prompt, text, drafted, kept):
        return {"constraint": "person", "prompt": prompt, "text": text,
                "speculation": {"draft_tokens": drafted, "accepted_tokens": kept}}

    constrained = [record("a", '{"name":"Ada"}', 10, 8), record("b", '{"name":"Bo"}', 10, 2),
                   record("c", "zz" * 20, 10, 10)]
    unconstrained = [record("a", "def f(x): return x", 10, 5), record("b", "\n#" * 48, 90, 90),
                     record("c", "import os", 10, 5)]
    passes = [constrained, unconstrained]
    assert structured.acceptance(constrained, None, None)["rate"] == pytest.approx(20 / 30)
    assert structured.acceptance(unconstrained, None, None)["rate"] == pytest.approx(100 / 110)
    looping = structured.looping_prompts(passes)
    assert looping == {("person", "b"), ("person", "c")}
    no_loops = [structured.acceptance([r for r in p if (r["constraint"], r["prompt"])
                                        not in looping], None, None) for p in passes]
    assert [t["rate"] for t in no_loops] == [0.8, 0.5]          # prompt "a" alone
    rounds = [{"outrider": {**system_round(0, (0.7, 0.6), (200, 210)), "acceptance": {
        "greedy": {"constrained": {**structured.acceptance(constrained, None, None),
                                   "without_loops": no_loops[0]},
                   "unconstrained": {**structured.acceptance(unconstrained, None, None),
                                     "without_loops": no_loops[1]}}}}}] * 2
    merged = structured.merge_rounds(rounds)
    cell = merged["outrider"]["acceptance"]["greedy"]["constrained"]["without_loops"]
    assert cell["draft_tokens"] == 20 and cell["rate_rounds"] == [0.8, 0.8]
    judged = structured.targets(merged)[2]
    assert judged["value"] == pytest.approx(0.8 / 0.5) and judged["met"]
    assert "| 0.800 (20) / 0.500 (20) |" in table_of(merged)


def test_a_cell_gives_tokens_per_second_and_the_median_tpot():
    records = [{"start": 0.0, "end": 1.0, "ttft": 0.1, "tokens": 10, "chunks": 4},  # 100 ms
               {"start": 0.0, "end": 0.5, "ttft": 0.1, "tokens": 5, "chunks": 2},   # a token
               {"start": 1.0, "end": 1.3, "ttft": 0.1, "tokens": 3, "chunks": 3},
               {"error": "APIConnectionError"}]
    cell = structured.summarize(records, 2.0)
    assert cell["tokens_per_s"] == pytest.approx(9.0) and cell["errors"] == 1
    assert cell["tpot_ms_p50"] == pytest.approx(100.0)
    assert cell["per_token_rate"] == pytest.approx(10.0)
    assert cell["first_error"] == "APIConnectionError"
    assert cell["tokens_per_chunk"] == pytest.approx(2.0)


def test_matched_requests_are_as_long_as_the_constrained_ones_in_either_order(monkeypatch):
    sent = []

    def recorded(client, endpoint, body):   # each output as long as max_tokens, less 3
        sent.append((mode_of(body), body["max_tokens"]))
        return {"start": 0.0, "end": 1.0, "ttft": 0.1, "tokens": body["max_tokens"] - 3,
                "chunks": 2}

    monkeypatch.setattr(structured, "stream", recorded)
    monkeypatch.setattr(structured, "LEVELS", (1,))
    items = structured.throughput_items([f"doc {i}" for i in range(6)])
    for reverse in (False, True):
        sent.clear()
        cells = structured.measure_throughput(None, {m: {1: items} for m in structured.MODES},
                                              96, reverse)["c1"]
        assert cells["constrained"]["output_tokens"] == [93] * 6
        assert cells["matched"]["output_tokens"] == [90] * 6     # capped at 93 each
        assert cells["unconstrained"]["output_tokens"] == [93] * 6
        # each pair interleaved by slices of 2 requests; the pairs' order reversed, and the
        # second pair's within it, but matched always after its constrained slice
        pairs = [["constrained", "matched"], ["unconstrained", "permissive"]]
        if reverse:
            pairs = [["permissive", "unconstrained"], ["constrained", "matched"]]
        assert [m for m, _ in sent[::2]] == [m for pair in pairs for _ in range(3) for m in pair]
        assert [m for m, _ in sent] == [m for m, _ in sent[::2] for _ in range(2)]


def mode_of(body: dict) -> str:
    """The throughput mode a request was sent in, read off its body."""
    regex = body.get("extra_body", {}).get("structured_outputs", {}).get("regex")
    if regex == structured.PERMISSIVE:
        return "permissive"
    if "response_format" in body or "extra_body" in body:
        return "constrained"
    return "unconstrained" if body["max_tokens"] == 96 else "matched"


def test_a_pairs_seconds_are_its_own_slices_wall_times(monkeypatch):
    """Interleaved, each mode's tok/s counts only the time its own slices took."""
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(structured.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(structured, "stream", lambda client, endpoint, body: {
        "start": 0.0, "end": 1.0, "ttft": 0.1, "tokens": 10, "chunks": 2})
    items = structured.throughput_items([f"doc {i}" for i in range(4)])
    cells = structured.measure_pair(None, {"constrained": items, "matched": items}, 1,
                                    ("constrained", "matched"), 96)
    # two slices each, every slice one tick of the clock: 2 s for 40 tokens per mode
    assert cells["constrained"]["seconds"] == cells["matched"]["seconds"] == 2.0
    assert cells["matched"]["tokens_per_s"] == 20.0


# -- rounds and targets ------------------------------------------------------------------------
def system_round(invalid: int, rates: tuple[float, float], per_token: tuple[float, float],
                 tokens_per_s: tuple[float, float] = (100.0, 100.0)) -> dict:
    """rates: acceptance constrained, unconstrained; per_token and tokens_per_s: constrained
    (permissive alike), matched (unconstrained alike)."""
    counts = {"total": 10, "valid": 10 - invalid, "invalid": invalid, "length": 0, "error": 0}
    spec = {mode: {"draft_tokens": 100, "accepted_tokens": int(100 * rate), "rate": rate,
                   "source": "usage.speculation",
                   "without_loops": {"draft_tokens": 50, "accepted_tokens": int(50 * rate),
                                 "rate": rate, "source": "usage.speculation"}}
            for mode, rate in zip(("constrained", "unconstrained"), rates)}
    cell = {mode: {"requests": 8, "errors": 0, "tokens_per_s": tokens_per_s[side],
                   "mean_tokens": 17.0, "tpot_ms_p50": 1e3 / per_token[side],
                   "per_token_rate": per_token[side], "first_error": None,
                   "output_tokens": [17] * 8}
            for mode, side in zip(structured.MODES, (0, 1, 1, 0))}
    return {"validity": {"greedy": counts, "sampled": dict(counts)},
            "acceptance": {"greedy": spec, "sampled": spec},
            "throughput": {"c1": cell, "c8": cell},
            "tool_calls": {"named greedy": dict(counts), "required sampled": dict(counts)}}


def test_rounds_merge_counts_summed_tokens_pooled_and_figures_averaged():
    rounds = [{"outrider": system_round(0, (0.7, 0.6), (200, 210), (100, 100))},
              {"outrider": system_round(1, (0.5, 0.6), (220, 210), (300, 100))}]
    merged = structured.merge_rounds(rounds)["outrider"]
    assert merged["validity"]["greedy"]["invalid"] == 1
    assert merged["validity"]["greedy"]["total"] == 20
    assert merged["acceptance"]["greedy"]["constrained"]["rate"] == pytest.approx(0.6)
    assert merged["acceptance"]["greedy"]["constrained"]["rate_rounds"] == [0.7, 0.5]
    cell = merged["throughput"]["c8"]["constrained"]
    assert cell["tokens_per_s"] == pytest.approx(200) and cell["per_token_rate"] == 210
    assert cell["tokens_per_s_rounds"] == [100, 300]
    assert "output_tokens" not in cell and "first_error" not in cell   # no figures


def test_targets_are_judged_for_outrider():
    results = structured.merge_rounds([{
        "outrider": system_round(0, (0.7, 0.6), (190, 200), (95, 100)),
        "vllm-draft": system_round(3, (0.1, 0.2), (1, 2), (95, 1))}])
    judged = {(t["target"], t.get("concurrency")): t for t in structured.targets(results)}
    validity = judged[("Outrider: invalid outputs among finished (stop) ones", None)]
    assert validity["value"] == 0 and validity["met"]     # vLLM's invalid ones are not judged
    assert judged[("Outrider: invalid tool calls among finished ones", None)]["met"]
    greedy = judged[("Outrider greedy: acceptance constrained over unconstrained, prompts "
                     "whose outputs do not loop", None)]
    assert greedy["value"] == pytest.approx(0.7 / 0.6) and greedy["met"]
    for name in ("Outrider: constrained throughput (tok/s) over unconstrained of the same "
                 "lengths", "Outrider: permissive per-token rate (1/TPOT p50) over unconstrained"):
        assert judged[(name, 1)]["value"] == pytest.approx(0.95) and judged[(name, 1)]["met"]
    worse = structured.merge_rounds([{"outrider": system_round(2, (0.5, 0.6), (170, 200),
                                                               (85, 100))}])
    assert not any(t["met"] for t in structured.targets(worse))
    ratios = structured.comparison(results)["outrider_over_vllm"]["c1"]["constrained"]
    assert ratios["per_token_rate"] == pytest.approx(190) and ratios["tokens_per_s"] == 1.0
    same_work = structured.comparison(results)["constrained_over_matched"]["outrider"]["c8"]
    assert same_work["tokens_per_s"] == pytest.approx(0.95)
    assert structured.targets({"vllm-draft": results["vllm-draft"]}) == []
    assert "| outrider | greedy | 10 | 10 | 0 | 0 | 0 |" in table_of(results)


# -- the command line --------------------------------------------------------------------------
def test_the_bench_flag_picks_the_structured_benchmark():
    args = build_parser().parse_args(["bench", "--structured"])
    assert _chosen_benchmark(args) is structured
    assert args.structured_systems == "outrider,vllm-draft" and args.structured_prompts == 3
    assert args.rounds == 2 and args.max_tokens == 96
    with pytest.raises(SystemExit, match="needs --vllm"):   # vllm-draft without vLLM
        structured.chosen_systems(args)
    alone = build_parser().parse_args(["bench", "--structured", "--structured-systems",
                                       "outrider"])
    assert structured.chosen_systems(alone) == ["outrider"]
    both = build_parser().parse_args(["bench", "--structured", "--vllm", "/x"])
    assert _chosen_benchmark(both) is structured
    assert structured.chosen_systems(both) == ["outrider", "vllm-draft"]
