"""The OpenAI-compatible HTTP API, driven by the official `openai` package against a live
router, target and draft (the shipped demo pair, whose tokenizer has a chat template: here
with Qwen3's switch for thinking added, `served_target`)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from outrider.router.chat_template import ChatTemplate
from outrider.router.http_api import error_response
from outrider.router.service import Refused

from outrider import paths
from outrider.client import Client
from outrider.core.tokenizer import Tokenizer
from tests.reliability._support import wait_until
from tests.router.demo_system import demo_chat_template, demo_system, openai_client
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

KEY = "or-http-test-key"
MODEL = "demo-target"
PROMPT = "def fibonacci(n):\n"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


# the demo target's template with Qwen3's switch after its generation prompt: a request's
# chat_template_kwargs {"enable_thinking": false} closes an empty think block there
GENERATION_PROMPT = "{{ '# assistant:\\n' }}"
THINK_OFF = ("{% if enable_thinking is defined and enable_thinking is false %}"
             "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def served_target(tmp_path_factory):
    """The demo target as served here: its files, its template switching thinking off."""
    template = demo_chat_template()
    assert template.count(GENERATION_PROMPT) == 1
    target = tmp_path_factory.mktemp("served") / "demo-target"  # (the model's name)
    target.mkdir()
    for file in paths.demo_target_dir().iterdir():
        (target / file.name).symlink_to(file)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = template.replace(GENERATION_PROMPT, GENERATION_PROMPT + THINK_OFF)
    (target / "tokenizer_config.json").unlink()
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def system(served_target):
    """With /metrics on every process (what the replica did for a client that left is
    read there)."""
    with demo_system(KEY, metrics=True, target=str(served_target)) as running:
        yield running


@pytest.fixture(scope="module")
def oai(system):
    return openai_client(system, KEY)


def test_models_lists_the_served_model(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL


def test_completion_equals_the_grpc_api_and_carries_speculation_usage(system, oai):
    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
    with Client(system.router, api_key=KEY, timeout_s=120) as client:
        same = client.generate(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    choice = done.choices[0]
    assert choice.text == same.text and choice.finish_reason == "length"
    assert done.usage.completion_tokens == 24
    assert done.usage.prompt_tokens == same.usage.prompt_tokens
    assert done.usage.total_tokens == done.usage.prompt_tokens + 24
    spec = done.usage.model_extra["speculation"]
    assert spec["rounds"] >= 1 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    assert spec["mean_accepted_len"] == pytest.approx(
        (spec["accepted_tokens"] + spec["rounds"]) / spec["rounds"])
    assert sum(p["draft_tokens"] for p in spec["by_proposer"].values()) == spec["draft_tokens"]
    # a request may name what proposes (an extra body field): the same greedy text
    ngram = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0,
                                   extra_body={"ignore_eos": True, "proposer": "ngram"})
    assert ngram.choices[0].text == choice.text
    assert set(ngram.usage.model_extra["speculation"]["by_proposer"]) <= {"ngram"}


def test_streamed_completion_equals_unary(oai):
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, **GREEDY)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2 and "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_chat_uses_the_models_template_streaming_or_not(oai, served_target):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "Sort a list."}]}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **GREEDY)
    prompt = ChatTemplate.from_dir(str(served_target)).render(
        [{"role": "system", "content": "You write Python."},
         {"role": "user", "content": "Sort a list."}])
    assert prompt.endswith("# assistant:\n")  # the shipped template's generation prompt
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                              stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_several_choices_and_prompts(oai):
    # FIXED γ: under AUTO, γ follows the load and a seed's sample depends on γ (README)
    seeded = dict(temperature=0.9, seed=11, max_tokens=12,
                  extra_body={"speculation": "fixed", "gamma": 3})
    both = oai.completions.create(model=MODEL, prompt=PROMPT, n=2, **seeded)
    first = oai.completions.create(model=MODEL, prompt=PROMPT, **seeded)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == first.choices[0].text  # choice i is seeded with seed + i
    batch = oai.completions.create(model=MODEL, prompt=[PROMPT, "import os\n"], max_tokens=5,
                                   **GREEDY)
    alone = oai.completions.create(model=MODEL, prompt="import os\n", max_tokens=5, **GREEDY)
    assert batch.choices[1].text == alone.choices[0].text
    assert batch.usage.completion_tokens == 10


BAD = [
    (dict(top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(temperature=-0.5), openai.BadRequestError, "temperature"),
    (dict(max_tokens=100_000), openai.BadRequestError, "max_tokens"),
    (dict(prompt=""), openai.BadRequestError, "prompt"),
    (dict(logprobs=21), openai.BadRequestError, "logprobs"),
    (dict(presence_penalty=2.5), openai.BadRequestError, "presence_penalty"),
    (dict(frequency_penalty=-3), openai.BadRequestError, "frequency_penalty"),
    (dict(logit_bias={"abc": 1}), openai.BadRequestError, "logit_bias"),
    (dict(logit_bias={"5": 200}), openai.BadRequestError, "logit_bias"),
    (dict(logit_bias={"999999": 1}), openai.BadRequestError, "logit_bias"),
    (dict(extra_body={"min_p": 1.5}), openai.BadRequestError, "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), openai.BadRequestError, "repetition_penalty"),
    (dict(extra_body={"min_tokens": 5}), openai.BadRequestError, "min_tokens"),
    (dict(extra_body={"top_k": -2}), openai.BadRequestError, "top_k"),
    (dict(echo=True, logprobs=2), openai.BadRequestError, "logprobs"),
    (dict(extra_body={"gamma": 99}), openai.BadRequestError, "gamma"),
    (dict(extra_body={"proposer": "bigram"}), openai.BadRequestError, "proposer"),
    (dict(extra_body={"tree_tokens": 70}), openai.BadRequestError, "tree_tokens"),
    (dict(extra_body={"tree_topk": 3}), openai.BadRequestError, "tree_topk"),  # (chains there)
    (dict(stop=["x"] * 1000), openai.BadRequestError, "stop"),
    (dict(model="no-such-model"), openai.NotFoundError, None),
]


@pytest.mark.parametrize("fields,error,param", BAD, ids=[str(b[2]) for b in BAD])
def test_errors_use_openai_statuses_and_format(oai, fields, error, param):
    with pytest.raises(error) as err:
        oai.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields})
    body = err.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["message"]
    assert body["param"] == param


def test_unknown_fields_are_ignored_named_and_counted(system, oai):
    """What vLLM clients send beyond the API (here two fields no server knows): served,
    the fields named in a header and counted; known vLLM extras are not among them."""
    before = total(scrape(system.http), "outrider_router_ignored_fields_total")
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={"bogus": 1, "zz_vendor_flag": True, "guided_choice": ["a", "b"]})
    assert raw.http_response.status_code == 200
    assert raw.headers["x-outrider-ignored-fields"] == "bogus, zz_vendor_flag"
    assert total(scrape(system.http), "outrider_router_ignored_fields_total") == before + 2


def test_vllm_extras_do_what_they_say(oai):
    """guided_* are structured outputs; chat_template_kwargs reach the template; each
    streamed chunk carries the usage so far under continuous_usage_stats."""
    choice = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["alpha", "beta"]})
    assert choice.choices[0].text in ("alpha", "beta")
    regex = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"guided_regex": "[0-9]{3}"})
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()
    with pytest.raises(openai.BadRequestError, match="one constraint"):
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={
            "guided_regex": "a", "guided_choice": ["b"]})
    def chat(max_tokens: int, **kwargs):
        return oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Sort a list."}],
            max_tokens=max_tokens, temperature=0,
            extra_body={"chat_template_kwargs": kwargs})

    off = chat(4, enable_thinking=False)
    assert off.choices[0].finish_reason == "length"
    # the served template branches on it (THINK_OFF): the prompts are what it renders
    tokenizer = Tokenizer(paths.demo_target_dir())
    asked = "# user:\nSort a list.\n# assistant:\n"
    assert off.usage.prompt_tokens == len(tokenizer.encode(f"{asked}<think>\n\n</think>\n\n"))
    assert chat(1, enable_thinking=True).usage.prompt_tokens == len(tokenizer.encode(asked))
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                   **GREEDY).choices[0].text
    stop = whole[8:12]
    for include, end in ((False, 0), (True, len(stop))):
        cut = oai.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop], temperature=0,
            extra_body={"include_stop_str_in_output": include, "skip_special_tokens": False})
        assert "x-outrider-ignored-fields" not in cut.headers
        assert cut.parse().choices[0].text == whole[:whole.index(stop) + end]
    chunks = list(oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 12, counts
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_chat_template_kwargs_are_variables_that_cannot_replace_the_messages():
    template = ChatTemplate("{% if think %}<think>{% endif %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}", {})
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages, extra={"think": True}) == "<think>hi"
    assert template.render(messages, extra={"messages": [{"content": "x"}]}) == "hi"


def test_a_long_template_given_inline_is_taken_as_the_template(tmp_path):
    """vLLM's --chat-template takes a template inline whatever its length; a name
    longer than a file name may be is not a file (it once stopped the router)."""
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}" + " " * 300
    template = ChatTemplate.from_dir(str(tmp_path), inline)
    assert template.render([{"role": "user", "content": "hi"}], extra={}).strip() == "hi"


def test_tokenize_detokenize_and_version(system):
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"http://{system.http}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read())

    tokens = post("/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert post("/detokenize", {"tokens": tokens["tokens"]})["prompt"] == PROMPT
    version = json.loads(urllib.request.urlopen(f"http://{system.http}/version").read())
    from outrider import __version__
    assert version == {"version": __version__}


def test_keys_are_checked_like_grpc(system):
    bad = openai.OpenAI(base_url=f"http://{system.http}/v1", api_key="or-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert err.value.status_code == 401 and "invalid API key" in err.value.body["message"]
    with pytest.raises(urllib.error.HTTPError) as missing:  # no header at all
        urllib.request.urlopen(f"http://{system.http}/v1/models", timeout=30)
    assert missing.value.code == 401
    assert "missing API key" in json.loads(missing.value.read())["error"]["message"]


def test_rate_limits_become_429_with_retry_after():
    response = error_response(Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", 2.4))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2" and response.headers["retry-after-ms"] == "2400"
    assert json.loads(response.body)["error"]["type"] == "rate_limit_error"


def replica_is_idle(metrics: str) -> bool:
    """No sequence running or waiting on the target replica, every KV block free (its
    /metrics gauges are read from the engine at scrape time)."""
    samples = scrape(metrics)
    return all(total(samples, name) == 0 for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"))


def test_a_client_that_leaves_mid_stream_frees_the_replica(system, oai):
    target, router = system.metrics["target"], system.metrics["router"]
    wait_until(lambda: replica_is_idle(target), 20)
    tokens_before = total(scrape(target), "vllm:generation_tokens_total")
    left_before = total(scrape(router), "outrider_requests_total", code="CANCELLED", api="http")
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, stream=True,
                                    **GREEDY)
    assert next(iter(stream)).choices[0].finish_reason is None  # it runs when the client goes
    stream.close()  # the connection goes; the replica must stop generating for it
    wait_until(lambda: replica_is_idle(target), 20)
    # the replica stopped it where the client left, not at its length: it did not run on
    # for nobody (1500 tokens take the demo pair several seconds)
    assert 0 < total(scrape(target), "vllm:generation_tokens_total") - tokens_before < 1500
    wait_until(lambda: total(scrape(router), "outrider_requests_total", code="CANCELLED",
                             api="http") == left_before + 1, 10)  # counted as a caller gone
    with Client(system.router, api_key=KEY, timeout_s=30) as client:
        wait_until(lambda: client.status().replicas[0].num_running == 0, 20)
        assert client.status().replicas[0].kv_used_blocks == 0


def test_concurrent_http_streams_do_not_disturb_each_other(oai):
    expected = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    texts: list[str] = []

    def one() -> None:
        chunks = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stream=True,
                                        **GREEDY)
        texts.append("".join(c.choices[0].text for c in chunks if c.choices))
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert texts == [expected.choices[0].text] * 6
