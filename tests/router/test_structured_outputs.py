"""Structured outputs through a live router, target and draft (the shipped demo pair):
OpenAI's `response_format` and vLLM's `structured_outputs` through the official `openai`
package, and the SDK's options over gRPC. Every output matches its constraint, greedy
and sampled, with speculation on and its drafted tokens counted; a constraint that does
not compile is refused before any replica sees it, naming it, and serving goes on."""

from __future__ import annotations

import json
import re

import openai
import pytest
from outrider.router.openai_protocol import ChatMessage

from outrider import paths
from outrider.client import Client, InvalidRequestError
from outrider.core.grammar import Grammars
from outrider.core.structured import StructuredOutput
from outrider.core.tokenizer import Tokenizer
from tests.router.demo_system import demo_chat_template, demo_system, openai_client
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

KEY = "or-structured-test-key"
MODEL = "demo-target"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999}}}
DATE = r"20\d\d-(0[1-9]|1[0-2])-[0-3]\d"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'  # bounded: it ends
MESSAGES = [{"role": "user", "content": "Describe the config as JSON."}]
SAMPLED = dict(temperature=0.9)
# AUTO may rightly turn speculation off for a request the draft does poorly on: FIXED
# makes every round draft, so that drafted tokens are verified under the grammar
SPECULATE = {"speculation": "fixed", "gamma": 4}


# the demo target's template, each assistant message's tool calls written after its
# content (arguments an object, as templates get them, in JSON): any other message
# renders as with the shipped template
MESSAGE = "{{ '# ' + message['role'] + ':\\n' + message['content'] + '\\n' }}"
CALLS = ("{% for call in message.tool_calls or [] %}{{ '<tool_call>' + call.function.name + "
         "' ' + (call.function.arguments if call.function.arguments is string else "
         "call.function.arguments | tojson) + '</tool_call>\\n' }}{% endfor %}")
TOOLS_TEMPLATE = demo_chat_template().replace(MESSAGE, MESSAGE + CALLS)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    assert demo_chat_template().count(MESSAGE) == 1  # (the calls come after each message)
    template = tmp_path_factory.mktemp("template") / "tools.jinja"  # --chat-template FILE
    template.write_text(TOOLS_TEMPLATE)
    with demo_system(KEY, metrics=True, chat_template=str(template)) as running:
        yield running


@pytest.fixture(scope="module")
def oai(system):
    return openai_client(system, KEY)


@pytest.fixture(scope="module")
def sdk(system):
    with Client(system.router, api_key=KEY, timeout_s=120) as client:
        yield client


def as_structured_output(constraint: dict) -> StructuredOutput:
    """vLLM's `structured_outputs` field as the engine's constraint."""
    (kind, value), = constraint.items()
    if kind == "json":
        return StructuredOutput("json_schema", json.dumps(value))
    return StructuredOutput(kind, value)


def grammar_takes(so: StructuredOutput, text: str) -> bool:
    """Whether llguidance's matcher takes `text` whole (as the demo tokenizer encodes it):
    what an output cut by its length must be, the start of one the grammar accepts."""
    tokenizer = Tokenizer(paths.demo_target_dir())
    ids = tokenizer.encode(text)
    grammars = Grammars(tokenizer.path, tokenizer.vocab_size, [0])  # EOS takes no part
    return grammars.allowed_len("cut", so, [], 0, ids) == len(ids)


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "count"} and isinstance(value["name"], str)
            and len(value["name"]) <= 16 and isinstance(value["count"], int)
            and 0 <= value["count"] <= 999)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "T0.9"])
def test_chat_json_schema_is_valid(oai, sampling):
    fmt = {"type": "json_schema", "json_schema": {"name": "config", "schema": SCHEMA,
                                                  "strict": True}}
    for seed in range(3):
        done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96,
                                           response_format=fmt, seed=seed,
                                           extra_body=SPECULATE, **sampling)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert matches_schema(choice.message.content), choice.message.content
        assert done.usage.model_extra["speculation"]["draft_tokens"] > 0


def test_completion_json_object_streams_valid_json(oai):
    """Greedy and sampled streams (FIXED γ: a seed gives one sample whatever the load): an
    ended one parses as an object, one cut by its length is the start of one (the grammar
    takes it whole), and some end."""
    finishes = []
    for sampling in (dict(temperature=0.0), *(dict(temperature=0.9, seed=s) for s in range(4))):
        text, finish = "", None
        for chunk in oai.completions.create(
                model=MODEL, prompt="config = ", max_tokens=120, stream=True,
                extra_body={"response_format": {"type": "json_object"}, **SPECULATE},
                **sampling):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == "length" and grammar_takes(StructuredOutput("json_object"), text)
        finishes.append(finish)
    assert "stop" in finishes, finishes


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "T0.9"])
@pytest.mark.parametrize("constraint,check", [
    ({"regex": DATE}, lambda t: re.fullmatch(DATE, t)),
    ({"choice": CHOICES}, lambda t: t in CHOICES),
    ({"grammar": GRAMMAR}, lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3}){0,2}\)", t)),
    ({"json": SCHEMA}, matches_schema),
], ids=["regex", "choice", "grammar", "json"])
def test_vllm_structured_outputs_hold(oai, constraint, check, sampling):
    """Each output cut by its length is the start of one the grammar accepts, at least one
    is whole and matches, and the drafted tokens were verified under the grammar."""
    done = oai.completions.create(model=MODEL, prompt="The value is ", max_tokens=48, n=2,
                                  seed=5, extra_body={"structured_outputs": constraint,
                                                      **SPECULATE},
                                  **sampling)
    for choice in done.choices:
        if choice.finish_reason == "stop":
            assert check(choice.text), choice.text
        else:
            assert choice.finish_reason == "length", choice
            assert grammar_takes(as_structured_output(constraint), choice.text), choice.text
    assert any(c.finish_reason == "stop" for c in done.choices), done.choices
    assert done.usage.model_extra["speculation"]["draft_tokens"] > 0, done.usage


def test_the_sdk_and_http_agree_and_speculation_runs(oai, sdk):
    over_grpc = sdk.generate("The date was ", max_tokens=24, temperature=0.0, regex=DATE,
                             speculation="fixed", gamma_max=4)
    over_http = oai.completions.create(model=MODEL, prompt="The date was ", max_tokens=24,
                                       temperature=0.0,
                                       extra_body={"structured_outputs": {"regex": DATE},
                                                   **SPECULATE})
    assert re.fullmatch(DATE, over_grpc.text) and over_grpc.finish_reason == "stop"
    assert over_http.choices[0].text == over_grpc.text
    assert over_grpc.speculation.draft_tokens > 0 and over_grpc.speculation.accepted_tokens > 0


def test_metrics_count_constrained_requests_and_mask_time(system, sdk):
    router, target = system.metrics["router"], system.metrics["target"]
    before = total(scrape(router), "outrider_structured_requests_total", kind="choice")
    drafted_before = total(scrape(router), "outrider_structured_draft_tokens_total",
                           kind="choice")
    masks_before = total(scrape(target), "outrider_grammar_mask_seconds_count")
    result = sdk.generate("Pick: ", max_tokens=8, temperature=0.0, choice=CHOICES,
                          speculation="fixed", gamma_max=4)
    after = scrape(router)
    assert total(after, "outrider_structured_requests_total", kind="choice") == before + 1
    assert (total(after, "outrider_structured_draft_tokens_total", kind="choice")
            == drafted_before + result.speculation.draft_tokens)
    assert total(scrape(target), "outrider_grammar_mask_seconds_count") > masks_before


def test_constrained_and_sampled_requests_keep_their_own_acceptance_statistics(sdk):
    """A grammar changes what the draft gets right, and so does the temperature: constrained
    requests are counted (and start from) `<tag>+structured`, sampled ones
    `<tag>@t<temperature to a tenth>`, greedy unconstrained ones their tag; status(tag)
    shows them all."""
    sdk.generate("Pick: ", max_tokens=8, temperature=0.0, choice=CHOICES, tag="stats-split",
                 speculation="fixed", gamma_max=4)
    tags = {a.tag for a in sdk.status(tag="stats-split").acceptance}
    assert tags == {"stats-split+structured"}
    sdk.generate("def f(x):\n", max_tokens=8, temperature=0.0, tag="stats-split",
                 speculation="fixed", gamma_max=4)
    tags = {a.tag for a in sdk.status(tag="stats-split").acceptance}
    assert tags == {"stats-split", "stats-split+structured"}
    sdk.generate("def f(x):\n", max_tokens=8, temperature=0.74, seed=3, tag="stats-split",
                 speculation="fixed", gamma_max=4)
    tags = {a.tag for a in sdk.status(tag="stats-split").acceptance}
    assert tags == {"stats-split", "stats-split+structured", "stats-split@t0.7"}


BAD = [
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured_outputs",
     "unclosed character class"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: nowhere"}}),
     "structured_outputs", "unknown name"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
     "structured_outputs", "exactly one"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs",
     "at least 1 item"),
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wat"}}}}), "response_format", "wat"),
    (dict(extra_body={"response_format": {"type": "json_schema"}}), "response_format",
     "json_schema is needed"),
    (dict(extra_body={"response_format": {"type": "json_object"},
                      "structured_outputs": {"regex": "a"}}), "structured_outputs", "not both"),
]


@pytest.mark.parametrize("fields,param,words", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_constraints_are_400_naming_them(oai, fields, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, **fields)
    body = err.value.body
    assert body["param"] == param and words in body["message"], body


def test_a_bad_constraint_over_grpc_names_the_field_and_serving_goes_on(sdk):
    with pytest.raises(InvalidRequestError, match=r"sampling\.structured_output\.json_schema"):
        sdk.generate("x", max_tokens=4, json_schema="{not json")
    with pytest.raises(InvalidRequestError, match=r"sampling\.structured_output\.regex"):
        sdk.generate("x", max_tokens=4, regex="(")
    # a schema keyword the engine does not implement is refused, not ignored
    with pytest.raises(InvalidRequestError, match=r"sampling\.structured_output\.json_schema"):
        sdk.generate("x", max_tokens=4, json_schema={"type": "array", "uniqueItems": True})
    assert sdk.generate("x", max_tokens=4, choice=["ok"]).text == "ok"


# -- tool calls a request forces ---------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid_call(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        return arguments in ({"zone": "utc"}, {"zone": "cet"})
    return (call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
            and len(arguments["city"]) <= 12 and arguments["unit"] in ("c", "f"))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "T0.9"])
def test_a_named_tool_choice_is_a_call_with_valid_arguments(oai, sampling):
    """The arguments keep to the function's parameters: they are the output's schema."""
    for seed in range(2):
        done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96,
                                           tools=[WEATHER, CLOCK], tool_choice=NAMED, seed=seed,
                                           extra_body=SPECULATE, **sampling)
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and valid_call(call)
        assert done.usage.model_extra["speculation"]["draft_tokens"] > 0


def test_required_tool_calls_are_one_or_more_of_the_tools(oai):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=200, tools=[WEATHER, CLOCK],
                   tool_choice="required", temperature=0.0, extra_body=SPECULATE)
    single = oai.chat.completions.create(parallel_tool_calls=False, **request).choices[0]
    assert single.finish_reason == "tool_calls" and single.message.content is None, single
    assert len(single.message.tool_calls) == 1 and valid_call(single.message.tool_calls[0])
    choice = oai.chat.completions.create(**request).choices[0]
    if choice.finish_reason == "tool_calls":
        calls = choice.message.tool_calls
        assert calls and all(valid_call(c) for c in calls)
        assert len({c.id for c in calls}) == len(calls)
    else:  # the small model may list calls until max_tokens: cut, and honest about it
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert choice.message.content.startswith('[{"name":"get_')


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_streamed_tool_call_adds_up_to_the_unary_one(oai, tool_choice):
    """Deltas as OpenAI streams them: a named call's id and name first, its arguments as
    they come; 'required' calls whole once the list is."""
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=200, tools=[WEATHER, CLOCK],
                   tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.0)
    unary = oai.chat.completions.create(**request).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == unary.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in unary.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_conversation_goes_on_after_a_tool_answers(oai):
    """An assistant's earlier call and the tool's answer are accepted as history and
    rendered, the call's name and arguments too (TOOLS_TEMPLATE): written by hand, or the
    returned message sent back as the openai package sends it; arguments too deep to
    parse are still only text."""
    tokenizer = Tokenizer(paths.demo_target_dir())

    def history(arguments: str) -> list[dict]:
        return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]

    def chat(messages: list):
        return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           tools=[CLOCK], tool_choice="none",
                                           temperature=0.0)

    def prompt(call: str) -> list[int]:  # the history as TOOLS_TEMPLATE renders it
        return tokenizer.encode(f"# user:\n{MESSAGES[0]['content']}\n# assistant:\n\n{call}"
                                "# tool:\n12:00\n# assistant:\n")

    done = chat(history('{"zone":"utc"}'))
    assert done.choices[0].message.tool_calls is None
    written = prompt('<tool_call>get_time {"zone": "utc"}</tool_call>\n')
    assert done.usage.prompt_tokens == len(written) > len(prompt(""))  # the call's tokens
    deep = ChatMessage.model_validate(history("[" * 50_000)[-2]).for_template()
    assert deep["tool_calls"][0]["function"]["arguments"] == "[" * 50_000  # still text
    with pytest.raises(openai.BadRequestError) as err:  # written as it is: too long
        chat(history("[" * 50_000))
    too_long = prompt(f"<tool_call>get_time {'[' * 50_000}</tool_call>\n")
    assert f"prompt has {len(too_long)} tokens" in err.value.message
    called = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96,
                                         tools=[CLOCK], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0.0)
    message = called.choices[0].message
    answered = [*MESSAGES, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                     "content": "12:00"}]
    done = chat(answered)
    assert done.choices[0].finish_reason in ("stop", "length")
    (call,) = message.tool_calls
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert done.usage.prompt_tokens == len(prompt(
        f"<tool_call>{call.function.name} {arguments}</tool_call>\n"))


def test_parameters_with_definitions_are_called_whichever_the_choice(oai):
    """Schemas as pydantic writes them: `$ref`s into `$defs` (each function's own,
    moved to the root of a 'required' list's schema under its name)."""
    place = {"type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"type": "string", "maxLength": 8}}}
    tools = [{"type": "function", "function": {"name": f, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["where"],
        "properties": {"where": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": place}}}}
        for f in ("go", "stay")]
    for tool_choice in ("required", {"type": "function", "function": {"name": "stay"}}):
        done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96,
                                           tools=tools, tool_choice=tool_choice,
                                           parallel_tool_calls=False, temperature=0.0)
        (call,) = done.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("go", "stay") and set(arguments) == {"where"}
        assert set(arguments["where"]) == {"city"} and len(arguments["where"]["city"]) <= 8


BAD_TOOLS = [
    (dict(tools=[WEATHER]), "auto"),                      # auto, the default with tools
    (dict(tools=[WEATHER], tool_choice="auto"), "auto"),
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "'nope'"),
    (dict(tools=[WEATHER], tool_choice=NAMED,
          response_format={"type": "json_object"}), "drop response_format"),
    (dict(tools=[WEATHER], tool_choice=NAMED, stop=["unit"]), "would cut the JSON"),
]


@pytest.mark.parametrize("fields,words", BAD_TOOLS, ids=[str(i) for i in range(len(BAD_TOOLS))])
def test_a_tool_choice_that_cannot_be_honoured_is_a_400_naming_it(oai, fields, words):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **fields)
    body = err.value.body
    assert body["param"] in ("tool_choice", "stop") and words in body["message"], body


def test_parameters_that_do_not_compile_are_a_400_naming_the_tools(oai):
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                        tools=[broken], tool_choice=tool_choice)
        body = err.value.body
        assert body["param"] == "tools" and "wat" in body["message"], body
