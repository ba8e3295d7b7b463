"""The sampling parameters (min_p, the penalties, logit_bias, min_tokens, logprobs) through
every served layer: the OpenAI-compatible HTTP API driven by the official `openai`
package, the gRPC SDK and the CLI, against one live router, target and draft (the shipped
demo pair)."""

from __future__ import annotations

import json
import math

import grpc
import openai
import pytest
from tokenizers import Tokenizer

from outrider import paths
from outrider.client import Client, InvalidRequestError
from outrider.client.request import build_request
from outrider.client.results import Logprob
from outrider.v1 import generate_pb2_grpc
from tests.cli_utils import run_cli
from tests.router.demo_system import demo_system, openai_client

pytestmark = pytest.mark.slow

KEY = "or-sampling-test-key"
MODEL = "demo-target"
PROMPT = "def fibonacci(n):\n"
REPEATING = "x = 1\nx = 1\nx = 1\nx = 1\n"
THE = 298  # " the" in the demo tokenizer: a plain text token
TOKENIZER = Tokenizer.from_file(str(paths.demo_target_dir() / "tokenizer.json"))
EOS = json.loads((paths.demo_target_dir() / "config.json").read_text())["eos_token_id"]
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Seeded samples depend on γ, so the seeded requests fix it (README)
EVERYTHING = dict(
    max_tokens=12, temperature=0.9, seed=5, n=2, stop=["\n\n\n\n"], presence_penalty=0.4,
    frequency_penalty=0.3, logit_bias={str(THE): 1.5, "3": -2.0},
    extra_body={"top_k": 50, "min_p": 0.001, "repetition_penalty": 1.1, "min_tokens": 3,
                "stop_token_ids": [4095], "speculation": "fixed", "gamma": 3})


@pytest.fixture(scope="module")
def system():
    with demo_system(KEY) as running:
        yield running


@pytest.fixture(scope="module")
def oai(system):
    return openai_client(system, KEY)


@pytest.fixture(scope="module")
def client(system):
    with Client(system.router, api_key=KEY, timeout_s=120) as c:
        yield c


def assert_top_list(values: list[float], k: int, chosen: float) -> None:
    """k finite logprobs, likeliest first; the chosen token's is <= 0 and <= the best."""
    assert len(values) == k
    assert all(math.isfinite(v) and v <= 0 for v in values)
    assert values == sorted(values, reverse=True)
    assert chosen <= 0 and (not values or chosen <= values[0] + 1e-6)


def completion_choices(response) -> dict[int, tuple[str, list, list, list]]:
    """index -> (text, chosen logprobs, top lists as [(token, logprob)], text offsets)."""
    return {c.index: (c.text, c.logprobs.token_logprobs,
                      [list(top.items()) for top in c.logprobs.top_logprobs],
                      c.logprobs.text_offset)
            for c in response.choices}


def streamed_completion_choices(chunks) -> dict[int, tuple[str, list, list, list]]:
    out: dict[int, tuple[str, list, list, list]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            text, chosen, tops, offsets = out.setdefault(c.index, ("", [], [], []))
            if c.logprobs:
                chosen += c.logprobs.token_logprobs
                tops += [list(top.items()) for top in c.logprobs.top_logprobs]
                offsets += c.logprobs.text_offset
            out[c.index] = (text + c.text, chosen, tops, offsets)
    return out


def assert_same_choices(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i][0] == b[i][0]
        assert a[i][1] == pytest.approx(b[i][1], abs=1e-5)
        assert [[t for t, _ in top] for top in a[i][2]] == [[t for t, _ in top] for top in b[i][2]]
        assert [v for top in a[i][2] for _, v in top] == pytest.approx(
            [v for top in b[i][2] for _, v in top], abs=1e-5)
        assert a[i][3] == b[i][3]  # text offsets


def test_completions_take_every_sampling_parameter_at_once(oai):
    unary = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **EVERYTHING)
    assert [c.index for c in unary.choices] == [0, 1]
    choices = completion_choices(unary)
    for c in unary.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
            == len(lp.text_offset) >= 3  # min_tokens
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert_top_list(list(top.values()), 3, chosen)
    # one entry per generated token, over both choices
    assert sum(len(c.logprobs.tokens) for c in unary.choices) == unary.usage.completion_tokens
    streamed = list(oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, stream=True,
                                           **EVERYTHING))
    assert_same_choices(streamed_completion_choices(streamed), choices)


def test_chat_takes_every_sampling_parameter_at_once(oai):
    messages = [{"role": "user", "content": "Write a loop."}]
    unary = oai.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                        top_logprobs=2, **EVERYTHING)
    assert [c.index for c in unary.choices] == [0, 1]
    for c in unary.choices:
        content = c.logprobs.content
        assert len(content) >= 3
        for entry in content:
            assert bytes(entry.bytes).decode(errors="replace") == entry.token
            assert_top_list([t.logprob for t in entry.top_logprobs], 2, entry.logprob)
    assert sum(len(c.logprobs.content) for c in unary.choices) == unary.usage.completion_tokens
    streamed: dict[int, tuple[str, list]] = {}
    for chunk in oai.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                             top_logprobs=2, stream=True, **EVERYTHING):
        for c in chunk.choices:
            text, entries = streamed.setdefault(c.index, ("", []))
            streamed[c.index] = (text + (c.delta.content or ""),
                                 entries + (c.logprobs.content if c.logprobs else []))
    for c in unary.choices:
        text, entries = streamed[c.index]
        assert text == c.message.content
        assert [e.token for e in entries] == [e.token for e in c.logprobs.content]
        assert [e.logprob for e in entries] == pytest.approx(
            [e.logprob for e in c.logprobs.content], abs=1e-5)


def test_logprobs_of_a_truncated_distribution_are_valid_json(oai):
    """top_k=2 leaves two tokens: the other alternatives have probability 0. The answer must
    still be JSON (no -Infinity) and say nothing a client cannot parse."""
    seeded = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.8, seed=1,
                  logprobs=5, extra_body={"top_k": 2, "speculation": "fixed", "gamma": 2})
    unary = oai.completions.create(**seeded)
    streamed = list(oai.completions.create(stream=True, **seeded))
    assert_same_choices(streamed_completion_choices(streamed), completion_choices(unary))
    for top in unary.choices[0].logprobs.top_logprobs:
        assert all(math.isfinite(v) for v in top.values())


def test_greedy_logprobs_over_http_equal_the_sdks(oai, client):
    http = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.0,
                                  logprobs=4, extra_body={"ignore_eos": True})
    sdk = client.generate(PROMPT, max_tokens=10, logprobs=4, **GREEDY)
    lp = http.choices[0].logprobs
    assert len(sdk.logprobs) == len(sdk.token_ids) == 10
    assert [x.token_id for x in sdk.logprobs] == list(sdk.token_ids)
    # the HTTP API shows each token as its id decoded alone
    assert lp.tokens == [TOKENIZER.decode([t]) for t in sdk.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in sdk.logprobs], abs=1e-5)
    for top, x in zip(lp.top_logprobs, sdk.logprobs):
        assert list(top) == [TOKENIZER.decode([t]) for t, _ in x.top]
        assert list(top.values()) == pytest.approx([v for _, v in x.top], abs=1e-5)
        # greedy: the chosen token is the likeliest
        assert x.top[0][0] == x.token_id and x.top[0][1] == pytest.approx(x.logprob)


def test_unary_generate_and_a_replayed_request_id_return_the_same_logprobs(system, client):
    options = dict(max_tokens=8, temperature=0.7, seed=3, logprobs=2, frequency_penalty=0.5,
                   speculation="fixed", gamma_max=3)
    streamed = client.generate(PROMPT, request_id="sampling-replay", **options)
    replayed = client.generate(PROMPT, request_id="sampling-replay", **options)
    with grpc.insecure_channel(system.router) as channel:
        unary = generate_pb2_grpc.GenerationStub(channel).Generate(
            build_request(PROMPT, **options), metadata=(("authorization", f"Bearer {KEY}"),),
            timeout=120)
    assert len(streamed.logprobs) == len(streamed.token_ids) == 8
    for other in (replayed.logprobs, tuple(Logprob.from_proto(lp) for lp in unary.logprobs)):
        assert [x.token_id for x in other] == [x.token_id for x in streamed.logprobs]
        assert [x.logprob for x in other] == pytest.approx(
            [x.logprob for x in streamed.logprobs], abs=1e-5)
        assert [len(x.top) for x in other] == [2] * 8
    assert list(unary.token_ids) == list(streamed.token_ids)


def test_sampled_logprobs_under_speculation_are_the_targets(client):
    """Accepted draft tokens and resampled ones alike report p, the target's distribution:
    each token's logprob is what a one-token request without speculation from the same
    prefix lists for it (top_k=20: every token is among its 20 alternatives)."""
    sampled = dict(temperature=0.9, top_k=20, ignore_eos=True)
    spec = client.generate(PROMPT, max_tokens=8, seed=21, speculation="fixed", gamma_max=4,
                           logprobs=0, **sampled)
    assert spec.speculation.accepted_tokens > 0
    prompt = TOKENIZER.encode(PROMPT).ids
    for i, lp in enumerate(spec.logprobs):
        one = client.generate(prompt + list(spec.token_ids[:i]), max_tokens=1, logprobs=20,
                              speculation="off", **sampled)
        assert lp.logprob == pytest.approx(dict(one.logprobs[0].top)[lp.token_id], abs=1e-4)


def test_a_large_logit_bias_forces_a_token(oai):
    forced = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                    logit_bias={str(THE): 100}, logprobs=1,
                                    extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " the" * 6
    # the logprobs are of the biased distribution: the forced token is all but certain
    assert all(-1e-3 < v <= 0 for v in forced.choices[0].logprobs.token_logprobs)


def test_chat_logprob_bytes_are_the_tokens_own_bytes(oai):
    """A token that is part of a UTF-8 character (byte 0xE2 of "—") has no text of its own;
    `bytes` is how a client puts such tokens back together (OpenAI's reference)."""
    e2 = TOKENIZER.encode("\u2014").ids[0]
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0.0, logprobs=True,
                                       logit_bias={str(e2): 100},
                                       extra_body={"ignore_eos": True})
    assert [e.bytes for e in chat.choices[0].logprobs.content] == [[0xE2], [0xE2]]


def test_a_negative_logit_bias_bans_the_greedy_token(client):
    plain = client.generate(PROMPT, max_tokens=4, **GREEDY)
    banned = client.generate(PROMPT, max_tokens=4, logit_bias={plain.token_ids[0]: -100},
                             logprobs=1, **GREEDY)
    assert banned.token_ids[0] != plain.token_ids[0]
    assert plain.token_ids[0] not in (t for t, _ in banned.logprobs[0].top)


def test_min_tokens_holds_back_a_strongly_biased_eos(client):
    eager = client.generate(PROMPT, max_tokens=20, temperature=0.0, logit_bias={EOS: 100})
    assert eager.token_ids == (EOS,) and eager.finish_reason == "stop"
    held = client.generate(PROMPT, max_tokens=20, temperature=0.0, logit_bias={EOS: 100},
                           min_tokens=5)
    unbiased = client.generate(PROMPT, max_tokens=5, **GREEDY)
    # five tokens (the unbiased greedy ones: EOS was the only change), then EOS at once
    assert held.token_ids == (*unbiased.token_ids, EOS)
    assert held.finish_reason == "stop"


def test_min_tokens_holds_back_stop_token_ids(client):
    plain = client.generate(PROMPT, max_tokens=8, **GREEDY)
    stop_id = plain.token_ids[1]
    early = client.generate(PROMPT, max_tokens=8, stop_token_ids=[stop_id], **GREEDY)
    assert early.token_ids[-1] == stop_id and len(early.token_ids) == 2
    late = client.generate(PROMPT, max_tokens=8, stop_token_ids=[stop_id], min_tokens=4,
                           **GREEDY)
    assert stop_id not in late.token_ids[:4]


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=1.0, presence_penalty=0.5),
    dict(presence_penalty=-1.0, min_tokens=6, logit_bias={THE: 3.0}),
], ids=["repetition", "frequency+presence", "negative-presence+min_tokens+bias"])
def test_penalties_change_greedy_output_and_stay_exact_under_speculation(client, penalties):
    plain = client.generate(REPEATING, max_tokens=24, **GREEDY)
    off = client.generate(REPEATING, max_tokens=24, speculation="off", logprobs=1,
                          **penalties, **GREEDY)
    spec = client.generate(REPEATING, max_tokens=24, speculation="fixed", gamma_max=4,
                           logprobs=1, **penalties, **GREEDY)
    assert off.token_ids != plain.token_ids
    assert spec.speculation.rounds < 24 and spec.speculation.draft_tokens > 0
    assert spec.token_ids == off.token_ids and spec.text == off.text
    assert [x.logprob for x in spec.logprobs] == pytest.approx(
        [x.logprob for x in off.logprobs], abs=1e-4)


def test_cli_generate_prints_logprobs_with_penalties_and_bias(system, client, monkeypatch):
    monkeypatch.setenv("OUTRIDER_API_KEY", KEY)
    out = run_cli("generate", "--address", system.router, "--json", "--max-tokens", "8",
                  "--temperature", "0", "--ignore-eos", "--logprobs", "2",
                  "--repetition-penalty", "1.2", "--logit-bias", f"{THE}=5", PROMPT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    same = client.generate(PROMPT, max_tokens=8, repetition_penalty=1.2, logit_bias={THE: 5.0},
                           logprobs=2, **GREEDY)
    assert result["token_ids"] == list(same.token_ids) and result["text"] == same.text
    assert [lp["token_id"] for lp in result["logprobs"]] == result["token_ids"]
    for lp, expected in zip(result["logprobs"], same.logprobs):
        assert len(lp["top"]) == 2 and lp["logprob"] <= 0
        assert lp["logprob"] == pytest.approx(expected.logprob, abs=1e-5)


def test_cli_local_generate_stops_at_a_stop_string(client):
    greedy = client.generate(PROMPT, max_tokens=16, **GREEDY).text
    stop = greedy[8:12]
    expected = greedy[:greedy.index(stop)]
    out = run_cli("generate", "--local", "--json", "--max-tokens", "16", "--temperature", "0",
                  "--ignore-eos", "--stop", stop, "--logprobs", "1", PROMPT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "stop"
    assert result["text"] == expected and stop not in result["text"]
    assert [lp["token_id"] for lp in result["logprobs"]] == result["token_ids"]


@pytest.mark.parametrize("options,field", [
    (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(logprobs=50), "logprobs"),
    (dict(logit_bias={999999: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=10, max_tokens=4), "min_tokens"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_grpc_refusals_name_the_field(client, options, field):
    with pytest.raises(InvalidRequestError) as err:
        client.generate(PROMPT, **options)
    assert err.value.code.name == "INVALID_ARGUMENT" and field in err.value.message


@pytest.mark.parametrize("fields,param", [
    (dict(top_logprobs=2), "top_logprobs"),                     # without logprobs: true
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens"),           # > max_tokens
], ids=lambda v: v if isinstance(v, str) else None)
def test_chat_refusals_name_the_param(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, **fields)
    assert err.value.body["param"] == param and err.value.body["message"]


@pytest.mark.parametrize("bias", [{"99999999999": 1}, {"\u00b2": 1}],
                         ids=["beyond-int32", "superscript-digit"])
def test_logit_bias_keys_that_are_not_token_ids_name_logit_bias(oai, bias):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert err.value.body["param"] == "logit_bias"
