"""Hostile input (docs/DESIGN.md §6 "bad input never crashes a process"): property
tests of the router's gRPC and HTTP APIs against one live router + target + draft,
about 2,100 cases in all, while a greedy stream runs beside them and must produce
exactly its expected tokens; then clients that stop reading mid-stream.

After each group: every process is alive, the router serves a normal request, and the
target and draft hold nothing. Cases stay cheap: valid requests ask for 1-3 tokens, the
rest are refused at validation. A request that does not even parse as protobuf
(malformed bytes, invalid UTF-8 in a string field) gets INVALID_ARGUMENT too, and an
HTTP body that is not decodable JSON an OpenAI-format 400."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import pytest
import requests
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outrider.router.openai_protocol import GUIDED, CompletionRequest

from outrider.client import Client
from outrider.launch import free_port, process_group
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc
from tests.reliability._support import Workers, record, reference_greedy, wait_until
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 64  # the live replica's batch: 70 streams overflow it
TOKEN = "reliability-hostile-token"
MODEL = "fuzz-target"
VOCAB = 300            # the test tokenizer's vocabulary (the checkpoint pads to 320)
CONTEXT = 512          # the test checkpoint's max_position_embeddings
MAX_GAMMA = 16
SEED_LIMIT = 2**63
# the first field number GenerateRequest does not define (later fields must not be
# fuzzed as "unknown": field 8 is resume_from, which needs a request_id)
FIRST_UNKNOWN_FIELD = max(f.number for f in gp.GenerateRequest.DESCRIPTOR.fields) + 1
# derandomized in CI (the same cases every run); OUTRIDER_FUZZ_RANDOM=1 explores anew
FUZZ = dict(deadline=None, derandomize=not os.environ.get("OUTRIDER_FUZZ_RANDOM"),
            database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])
BACKGROUND_PROMPT = [5, 17, 42, 99, 3, 250, 7, 61]
BACKGROUND_TOKENS = 48
# between background streams: back to back they cost the module a third of its CPU (193
# CPU s alone, 128 with the pause), and a stream a second beside the fuzz checks as much
BACKGROUND_PAUSE_S = 1.0


@dataclass
class Live:
    router: str
    http: str
    workers: Workers
    procs: dict
    target_metrics: str                                 # the target's /metrics
    raw_unary: object = None
    raw_stream: object = None
    stub: object = None
    cases: dict = field(default_factory=dict)          # examples run, by group
    references: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def live(llama_dir, draft_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz") / MODEL  # the served model id: its folder name
    shutil.copytree(llama_dir, model)
    with process_group(TOKEN) as start:
        draft_proc, draft = start("draft-worker", "--model", str(draft_dir))
        metrics_port = free_port()  # (each just before its process binds it)
        target_proc, target = start("target-worker", "--model", str(model), "--draft-address",
                                    draft, "--metrics-port", str(metrics_port),
                                    "--max-num-seqs", str(MAX_NUM_SEQS))
        http_port = free_port()
        router_proc, router = start("router", "--model", str(model), "--target-address",
                                    target, "--port", "0", "--http-port", str(http_port))
        with grpc.insecure_channel(router) as channel:
            system = Live(router, f"127.0.0.1:{http_port}", Workers(target, draft, TOKEN),
                          {"router": router_proc, "target": target_proc, "draft": draft_proc},
                          f"127.0.0.1:{metrics_port}")
            # raw bytes in, raw bytes out: what a hostile client can send
            system.raw_unary = channel.unary_unary("/outrider.v1.Generation/Generate")
            system.raw_stream = channel.unary_stream("/outrider.v1.Generation/GenerateStream")
            system.stub = generate_pb2_grpc.GenerationStub(channel)
            yield system
            record("hostile_input_cases", **system.cases)


@pytest.fixture(scope="module")
def expected_background(llama_dir):
    return reference_greedy(llama_dir, [BACKGROUND_PROMPT], BACKGROUND_TOKENS)[0]


class Background:
    """Greedy streams one after another (BACKGROUND_PAUSE_S apart) for as long as the
    block runs; each must give exactly the expected tokens."""

    def __init__(self, router: str, expected: list[int]) -> None:
        self.router, self.expected = router, expected
        self.runs, self.wrong, self.errors = 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with Client(self.router, timeout_s=120) as client:
            while not self._stop.is_set():
                try:
                    tokens = [t for d in client.stream(
                        BACKGROUND_PROMPT, max_tokens=BACKGROUND_TOKENS, temperature=0.0,
                        ignore_eos=True, speculation="fixed", gamma_max=3) for t in d.token_ids]
                except Exception as exc:  # noqa: BLE001 - reported by check()
                    self.errors.append(repr(exc))
                    continue
                self.runs += 1
                self.wrong += tokens != self.expected
                self._stop.wait(BACKGROUND_PAUSE_S)

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def check(self) -> None:
        assert self.errors == [] and self.wrong == 0 and self.runs >= 1, \
            (self.runs, self.wrong, self.errors[:3])


@contextmanager
def undisturbed(live: Live, expected: list[int]):
    """Run the block beside a background greedy stream; afterwards the stream was right,
    the processes live, a normal request is served and nothing is held."""
    with Background(live.router, expected) as background:
        yield
    background.check()
    healthy(live, expected)


def healthy(live: Live, expected: list[int]) -> float:
    """Every process alive, a normal request served right, then nothing held (returns
    the seconds that took)."""
    assert {n: p.poll() for n, p in live.procs.items()} == {n: None for n in live.procs}
    with Client(live.router, timeout_s=60) as client:
        done = client.generate(BACKGROUND_PROMPT, max_tokens=8, temperature=0.0,
                               ignore_eos=True)
    assert list(done.token_ids) == expected[:8]
    return live.workers.wait_idle(timeout_s=20)


def generated_tokens(live: Live) -> float:
    """Tokens the target has committed so far, over all requests (its /metrics)."""
    return total(scrape(live.target_metrics), "vllm:generation_tokens_total")


def call(live: Live, body: bytes, streaming: bool) -> tuple[grpc.StatusCode, str, list]:
    """Send serialized bytes; (status, details, response messages)."""
    try:
        if streaming:
            raw = list(live.raw_stream(body, timeout=60))
        else:
            raw = [live.raw_unary(body, timeout=60)]
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []
    return grpc.StatusCode.OK, "", [gp.GenerateResponse.FromString(b) for b in raw]


# -- strategies: requests ------------------------------------------------------------------
texts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=200)
token_prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=200)
valid_tags = st.from_regex(r"[A-Za-z0-9_.-]{0,64}", fullmatch=True)


@st.composite
def valid_requests(draw) -> gp.GenerateRequest:
    req = gp.GenerateRequest()
    if draw(st.booleans()):
        req.text = draw(texts)
    else:
        req.token_ids.ids.extend(draw(token_prompts))
    s = req.sampling
    s.max_tokens = draw(st.integers(1, 3))
    if draw(st.booleans()):
        s.temperature = draw(st.sampled_from([0.0, 1e-30, 3e38]) |
                             st.floats(0, 5, allow_nan=False, width=32))
    if draw(st.booleans()):
        s.top_p = draw(st.floats(0.5**20, 1.0, width=32))
    s.top_k = draw(st.integers(0, 2**32 - 1))
    s.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=4)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, SEED_LIMIT - 1))
    s.ignore_eos = draw(st.booleans())
    req.speculation.mode = draw(st.integers(0, 2))
    req.speculation.gamma_max = draw(st.integers(0, MAX_GAMMA))
    req.tag = draw(valid_tags)
    req.include_rounds = draw(st.booleans())
    return req


BAD_VALUES = st.one_of(
    st.tuples(st.just("sampling.temperature"),
              st.sampled_from([math.nan, math.inf, -math.inf]) | st.floats(-1e30, -1e-6)
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r.sampling, "temperature", v))),
    st.tuples(st.just("sampling.top_p"),
              st.sampled_from([math.nan, math.inf, -math.inf, 0.0]) | st.floats(1.001, 1e30) |
              st.floats(-1e30, -1e-6)
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r.sampling, "top_p", v))),
    st.tuples(st.just("sampling.max_tokens"), st.just(0) | st.integers(CONTEXT + 1, 2**32 - 1)
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r.sampling, "max_tokens", v))),
    st.tuples(st.just("sampling.seed"), st.integers(SEED_LIMIT, 2**64 - 1)
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r.sampling, "seed", v))),
    st.tuples(st.just("sampling.stop"), st.integers(65, 5000)
              ).map(lambda t: (t[0], lambda r, v=t[1]: r.sampling.stop.extend(["x"] * v))),
    st.tuples(st.just("sampling.stop"), st.just("") | st.text(min_size=257, max_size=400)
              ).map(lambda t: (t[0], lambda r, v=t[1]: r.sampling.stop.append(v))),
    st.tuples(st.just("sampling.stop_token_ids"),
              st.integers(-2**31, -1) | st.integers(VOCAB, 2**31 - 1)
              ).map(lambda t: (t[0], lambda r, v=t[1]: r.sampling.stop_token_ids.append(v))),
    st.tuples(st.just("sampling.stop_token_ids"), st.integers(257, 3000)
              ).map(lambda t: (t[0],
                               lambda r, v=t[1]: r.sampling.stop_token_ids.extend([1] * v))),
    st.tuples(st.just("token_ids"), st.integers(-2**31, -1) | st.integers(VOCAB, 2**31 - 1)
              ).map(lambda t: (t[0], lambda r, v=t[1]: r.token_ids.ids.extend([5, v]))),
    st.tuples(st.just("token_ids"), st.just(None)
              ).map(lambda t: (t[0], lambda r, v=None: r.token_ids.SetInParent())),
    st.tuples(st.just("prompt"), st.integers(CONTEXT, 5000)   # longer than the context
              ).map(lambda t: (t[0], lambda r, v=t[1]: r.token_ids.ids.extend([7] * v))),
    st.tuples(st.just("prompt"), st.integers(CONTEXT, 20000)
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r, "text", "ab " * v))),
    st.tuples(st.just("text"), st.sampled_from([0, 2**20 + 1])
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r, "text", "a" * v))),
    st.tuples(st.just("speculation.mode"), st.integers(3, 2**31 - 1) | st.integers(-2**31, -1)
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r.speculation, "mode", v))),
    st.tuples(st.just("speculation.gamma_max"), st.integers(MAX_GAMMA + 1, 2**32 - 1)
              ).map(lambda t: (t[0],
                               lambda r, v=t[1]: setattr(r.speculation, "gamma_max", v))),
    st.tuples(st.just("request_id"), st.text(min_size=1, max_size=200).filter(
        lambda x: not (len(x) <= 128 and all(c.isascii() and (c.isalnum() or c in "_.:-")
                                             for c in x)))
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r, "request_id", v))),
    st.tuples(st.just("tag"), st.text(min_size=1, max_size=100).filter(
        lambda x: not (len(x) <= 64 and all(c.isascii() and (c.isalnum() or c in "_.-")
                                            for c in x)))
              ).map(lambda t: (t[0], lambda r, v=t[1]: setattr(r, "tag", v))),
    st.tuples(st.just("prompt"), st.just(None)
              ).map(lambda t: (t[0], lambda r, v=None: r.ClearField("prompt"))),
)


# -- gRPC ------------------------------------------------------------------------------------
def test_grpc_valid_requests_are_served(live, expected_background):
    """300 valid requests of every shape (text or ids, any sampling, stop strings and
    ids, seeds, modes, tags, unknown fields): OK, at most max_tokens tokens."""
    n = 0

    @settings(max_examples=300, **FUZZ)
    @given(req=valid_requests(), streaming=st.booleans(),
           unknown=st.lists(st.tuples(st.integers(FIRST_UNKNOWN_FIELD, 18999),
                                      st.sampled_from([0, 1, 2, 5]),
                                      st.binary(max_size=16)), max_size=3))
    def case(req, streaming, unknown):
        nonlocal n
        n += 1
        body = req.SerializeToString() + b"".join(unknown_field(*u) for u in unknown)
        code, details, msgs = call(live, body, streaming)
        assert code == grpc.StatusCode.OK, (code, details, req)
        last = msgs[-1]
        assert last.finish_reason in ("length", "stop")
        assert len([t for m in msgs for t in m.token_ids]) == last.usage.completion_tokens
        assert last.usage.completion_tokens <= req.sampling.max_tokens

    with undisturbed(live, expected_background):
        case()
    live.cases["grpc_valid"] = n


def test_grpc_invalid_fields_are_refused_and_named(live, expected_background):
    """500 requests with one bad field (NaN/inf/negative temperature, top_p outside
    (0, 1], huge or zero max_tokens, huge seeds, thousands of stop strings or ids,
    out-of-vocabulary and negative ids, prompts over the context or the size limit,
    unknown modes, bad ids and tags, no prompt): INVALID_ARGUMENT naming the field."""
    n = 0

    @settings(max_examples=500, **FUZZ)
    @given(req=valid_requests(), bad=BAD_VALUES, streaming=st.booleans())
    def case(req, bad, streaming):
        nonlocal n
        n += 1
        name, mutate = bad
        if name in ("token_ids", "prompt") or name == "text":
            req.ClearField("prompt")
        mutate(req)
        code, details, _ = call(live, req.SerializeToString(), streaming)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, name)
        assert name.split(".")[-1] in details, (name, details)

    with undisturbed(live, expected_background):
        case()
    live.cases["grpc_invalid"] = n


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def unknown_field(number: int, wire_type: int, payload: bytes) -> bytes:
    """A field this schema does not have, well formed for its wire type."""
    key = varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + varint(int.from_bytes(payload[:9] or b"\0", "little") & (2**64 - 1))
    if wire_type == 1:
        return key + payload[:8].ljust(8, b"\0")
    if wire_type == 5:
        return key + payload[:4].ljust(4, b"\0")
    return key + varint(len(payload)) + payload


def invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


SMALL = gp.GenerateRequest(sampling=gp.SamplingOptions(max_tokens=2)).SerializeToString()
# where a string field can carry bytes: (path of enclosing fields, field number)
STRING_FIELDS = [((), 1), ((), 5), ((), 6), ((3,), 5)]


def string_field(path: tuple[int, ...], number: int, value: bytes) -> bytes:
    body = varint(number << 3 | 2) + varint(len(value)) + value
    for enclosing in reversed(path):
        body = varint(enclosing << 3 | 2) + varint(len(body)) + body
    return body


def test_grpc_hostile_bytes(live, expected_background):
    """400 byte strings: random bytes, truncated requests, invalid UTF-8 in each string
    field, unknown fields. What protobuf can parse gets the answer the parsed request
    deserves; what it cannot is refused with INVALID_ARGUMENT before the service sees
    it; no process notices."""
    n, unparsable = 0, 0
    valid = valid_requests().map(lambda r: r.SerializeToString())
    bodies = st.one_of(
        st.binary(max_size=300).map(lambda b: b + SMALL),       # SMALL caps max_tokens at 2
        st.tuples(valid, st.floats(0, 1)).map(lambda t: t[0][:int(len(t[0]) * t[1])]),
        st.tuples(valid, st.sampled_from(STRING_FIELDS),
                  st.binary(min_size=1, max_size=40).filter(invalid_utf8)).map(
            lambda t: t[0] + string_field(*t[1], t[2])),
        st.tuples(valid, st.integers(FIRST_UNKNOWN_FIELD, 2**29 - 1).filter(
            lambda x: not 19000 <= x <= 19999),
                  st.sampled_from([0, 1, 2, 5]), st.binary(max_size=64)).map(
            lambda t: t[0] + unknown_field(*t[1:])))

    @settings(max_examples=400, **FUZZ)
    @given(body=bodies, streaming=st.booleans())
    def case(body, streaming):
        nonlocal n, unparsable
        n += 1
        try:
            parsed = gp.GenerateRequest.FromString(body)
        except DecodeError:
            parsed = None
        code, details, msgs = call(live, body, streaming)
        if parsed is None:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert details.startswith("request"), details
            unparsable += 1
            return
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.ALREADY_EXISTS), (code, details)
        if code == grpc.StatusCode.OK:
            assert msgs[-1].finish_reason in ("length", "stop")

    with undisturbed(live, expected_background):
        case()
    live.cases["grpc_bytes"] = n
    live.cases["grpc_bytes_unparsable"] = unparsable


# -- HTTP ------------------------------------------------------------------------------------
KNOWN_KEYS = {*CompletionRequest.model_fields, *GUIDED}  # every other key is unknown


@st.composite
def valid_bodies(draw) -> dict:
    prompt = draw(st.one_of(texts, token_prompts, st.lists(texts, min_size=1, max_size=2),
                            st.lists(token_prompts, min_size=1, max_size=2)))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": draw(st.integers(1, 3)),
            "n": draw(st.integers(1, 2)), "stream": draw(st.booleans())}
    optional = {
        "temperature": st.floats(0, 5, allow_nan=False), "top_p": st.floats(1e-6, 1.0),
        "top_k": st.integers(0, 2**32 - 1), "stop": st.text(min_size=1, max_size=8) |
        st.lists(st.text(min_size=1, max_size=8), max_size=4),
        "seed": st.integers(0, SEED_LIMIT - 1), "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=8),
        "speculation": st.sampled_from(["auto", "off", "fixed"]),
        "gamma": st.integers(0, MAX_GAMMA), "tag": valid_tags, "echo": st.booleans(),
        "user": st.text(max_size=20), "presence_penalty": st.just(0.0),
        "logprobs": st.none(), "best_of": st.just(1),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6)):
        body[key] = draw(optional[key])
    return body


def post(live: Live, path: str, body, raw: bool = False) -> requests.Response:
    data = body if raw else json.dumps(body)
    return requests.post(f"http://{live.http}{path}", data=data, timeout=60,
                         headers={"Content-Type": "application/json"})


def test_http_valid_bodies_are_served(live, expected_background):
    """200 valid completion bodies (text, ids, several prompts, n, streaming or not,
    extensions): 200 with every choice, or a stream that ends in [DONE] with no error."""
    n = 0

    @settings(max_examples=200, **FUZZ)
    @given(body=valid_bodies())
    def case(body):
        nonlocal n
        n += 1
        response = post(live, "/v1/completions", body)
        assert response.status_code == 200, (response.text, body)
        prompts = 1 if isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int) \
            else len(body["prompt"])
        if body["stream"]:
            events = [line[6:] for line in response.text.split("\n")
                      if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("error" not in c for c in chunks)
            finished = {c["choices"][0]["index"] for c in chunks
                        if c["choices"] and c["choices"][0]["finish_reason"]}
            assert finished == set(range(prompts * body["n"]))
        else:
            assert len(response.json()["choices"]) == prompts * body["n"]

    with undisturbed(live, expected_background):
        case()
    live.cases["http_valid"] = n


HTTP_BAD = st.one_of(
    st.tuples(st.just("temperature"), st.floats(-1e300, -1e-9)),
    st.tuples(st.just("top_p"), st.floats(1.001, 1e300) | st.floats(-1e300, 0.0)),
    st.tuples(st.just("max_tokens"), st.integers(-2**70, 0) | st.integers(CONTEXT + 1, 2**70)),
    st.tuples(st.just("n"), st.integers(-2**40, 0) | st.integers(17, 2**40)),
    st.tuples(st.just("seed"), st.integers(-2**70, -1) | st.integers(SEED_LIMIT, 2**80)),
    st.tuples(st.just("stop"), st.integers(65, 3000).map(lambda k: ["s"] * k)),
    st.tuples(st.just("stop_token_ids"), st.lists(st.integers(-2**40, -1) |
                                                  st.integers(VOCAB, 2**40), min_size=1,
                                                  max_size=3)),
    st.tuples(st.just("prompt"), st.lists(st.integers(-2**40, -1) | st.integers(VOCAB, 2**40),
                                          min_size=1, max_size=3)),
    st.tuples(st.just("prompt"), st.integers(CONTEXT, 4000).map(lambda k: [7] * k)),
    st.tuples(st.just("prompt"), st.sampled_from([[], "", [[]], [""]])),
    st.tuples(st.just("speculation"), st.text(max_size=10).filter(
        lambda x: x not in ("auto", "off", "fixed"))),
    st.tuples(st.just("gamma"), st.integers(MAX_GAMMA + 1, 2**32 - 1)),
    st.tuples(st.just("logprobs"), st.integers(21, 2**40) | st.integers(-2**40, -1)),
    st.tuples(st.just("presence_penalty"), st.floats(2.001, 1e300) | st.floats(-1e300, -2.001)),
    st.tuples(st.just("frequency_penalty"), st.floats(2.001, 1e300) | st.floats(-1e300, -2.001)),
    st.tuples(st.just("repetition_penalty"), st.floats(-1e300, 0.0)),
    st.tuples(st.just("min_p"), st.floats(1.001, 1e300) | st.floats(-1e300, -1e-9)),
    st.tuples(st.just("logit_bias"),  # keys that are not token ids, or biases past ±100
              st.dictionaries(st.text(max_size=4).filter(lambda k: not (k.isascii()
                                                                         and k.isdigit())),
                              st.floats(1, 5), min_size=1, max_size=2)
              | st.dictionaries(st.sampled_from(["1", "7"]), st.floats(100.001, 1e300),
                                min_size=1, max_size=1)),
    st.tuples(st.just("best_of"), st.integers(2, 5)),
    st.tuples(st.just("tag"), st.text(min_size=65, max_size=80)),
    st.tuples(st.just("request_id"), st.text(min_size=129, max_size=140)),
    st.tuples(st.text(min_size=1, max_size=20).filter(lambda k: k not in KNOWN_KEYS),
              st.none() | st.integers() | st.text(max_size=5)),   # unknown keys
)


def test_http_invalid_bodies_are_refused_in_openai_format(live, expected_background):
    """300 bodies with one bad or unknown field: a bad value is a 400 in OpenAI's error
    format, an unknown field is ignored and named (JSON-escaped) in the answer's
    X-Outrider-Ignored-Fields header, whatever its name holds; NaN and Infinity refused."""
    n = 0

    @settings(max_examples=300, **FUZZ)
    @given(body=valid_bodies(), bad=HTTP_BAD)
    def case(body, bad):
        nonlocal n
        n += 1
        key, value = bad
        body[key] = value
        response = post(live, "/v1/completions", body)
        if key not in KNOWN_KEYS:
            assert response.status_code == 200, (response.text, bad)
            named = response.headers["X-Outrider-Ignored-Fields"]
            assert named == json.dumps(key)[1:-1][:64], (named, key)
            return
        assert response.status_code == 400, (response.status_code, response.text, bad)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]

    with undisturbed(live, expected_background):
        case()
        for literal in ("NaN", "Infinity", "-Infinity", "1e400"):
            for key in ("temperature", "top_p"):
                text = f'{{"model": "{MODEL}", "prompt": "x", "{key}": {literal}}}'
                response = post(live, "/v1/completions", text, raw=True)
                assert response.status_code == 400 and response.json()["error"]["param"] == key
                n += 1
    live.cases["http_invalid"] = n


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


def test_http_random_json_and_bytes(live, expected_background):
    """400 random bodies on both generation routes: any JSON value, a valid body's keys
    with random values, raw bytes, invalid UTF-8 inside strings. Never a 5xx: 200 only
    for a body that is valid, otherwise 400 (or 404 for another model) in OpenAI's
    error format."""
    n = 0
    optional = {k: json_values for k in sorted(KNOWN_KEYS - {"model", "prompt"})}
    valid_keys = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": json_values},
                                       optional=optional)
    bodies = st.one_of(
        json_values.map(json.dumps), valid_keys.map(json.dumps),
        st.binary(max_size=200),
        st.tuples(st.binary(min_size=1, max_size=20).filter(invalid_utf8)).map(
            lambda t: b'{"model": "' + MODEL.encode() + b'", "prompt": "' + t[0] + b'"}'))

    @settings(max_examples=400, **FUZZ)
    @given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def case(body, path):
        nonlocal n
        n += 1
        if isinstance(body, str):  # keep the work small when a body happens to be valid
            try:
                value = json.loads(body)
            except ValueError:
                value = None
            if isinstance(value, dict):
                for limit in ("max_tokens", "max_completion_tokens"):
                    if not isinstance(value.get(limit), int) or 2 < value[limit] <= CONTEXT:
                        value[limit] = 2
                body = json.dumps(value)
        response = post(live, path, body, raw=True)
        assert response.status_code in (200, 400, 404), (response.status_code, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["type"] in ("invalid_request_error", "not_found_error") and \
                error["message"], error

    with undisturbed(live, expected_background):
        case()
    live.cases["http_random"] = n


# -- clients that stall or leave -------------------------------------------------------------
# γ = 8 makes a long request slow (each round drafts 8 tokens on the draft replica; the
# draft model proposes, not the lookups, which copy the repetitive output of the random
# test model for free): 8 of them at once need ~10 s on 2 cores, so they are still
# running when the clients that stalled leave (at ~3 s), and their leaving is what stops
# them
LONG_GAMMA = 8
LONG = gp.GenerateRequest(token_ids=gp.TokenIds(ids=[5, 6, 7]),
                          sampling=gp.SamplingOptions(max_tokens=450, temperature=0.0,
                                                      ignore_eos=True),
                          speculation=gp.SpeculationOptions(mode=gp.SPECULATION_MODE_FIXED,
                                                            gamma_max=LONG_GAMMA),
                          proposer="model")


def test_grpc_clients_that_stop_reading(live, expected_background):
    """Eight streams read one message and then nothing for 3 s while other requests
    come and go unharmed; one then reads to the end and has every token, the others
    cancel (and one more never reads and lets its 2 s deadline pass): the replica is
    freed."""
    reference = reference_greedy_cached(live, [5, 6, 7], 450)
    live.workers.wait_idle()
    before = generated_tokens(live)
    stalled = [live.stub.GenerateStream(LONG, timeout=120) for _ in range(8)]
    firsts = [next(s) for s in stalled]
    short_deadline = live.stub.GenerateStream(LONG, timeout=2.0)  # never read
    served = 0
    with Client(live.router, timeout_s=60) as client:
        start = time.monotonic()
        while time.monotonic() - start < 3.0:  # the stalled streams sit still meanwhile
            done = client.generate(BACKGROUND_PROMPT, max_tokens=8, temperature=0.0,
                                   ignore_eos=True)
            assert list(done.token_ids) == expected_background[:8]
            served += 1
    running = live.workers.held()["num_running"]
    # the eight stalled streams' sequences still run; the one past its deadline was stopped
    assert running == 8
    with pytest.raises(grpc.RpcError) as expired:
        list(short_deadline)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for s in stalled[1:]:
        s.cancel()
    # only the first stream's sequence may still run
    freed_s = wait_until(lambda: live.workers.held()["num_running"] <= 1, 20, 0.05)
    rest = [t for m in stalled[0] for t in m.token_ids]  # it reads again: every token
    assert list(firsts[0].token_ids) + rest == reference
    live.workers.wait_idle()
    # those that left were stopped on the replica, not run on to their length for nobody
    assert generated_tokens(live) - before < 9 * 450 + 8 * served
    healthy(live, expected_background)
    record("grpc_stalled_clients", streams=9, running_while_stalled=running,
           freed_after_cancel_s=round(freed_s, 2))


def reference_greedy_cached(live: Live, prompt: list[int], max_tokens: int) -> list[int]:
    """The uninterrupted greedy output, from the live system (greedy is greedy)."""
    key = (tuple(prompt), max_tokens)
    cache = live.references
    if key not in cache:
        with Client(live.router, timeout_s=120) as client:
            cache[key] = list(client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True, speculation="off").token_ids)
    return cache[key]


def test_http_sse_client_that_stops_reading_then_disconnects(live, expected_background):
    """Raw-socket SSE clients with a tiny receive buffer read the headers and stop
    reading; other requests are unharmed; when they close the connection the router
    cancels their generations and the replica is freed."""
    host, port = live.http.split(":")
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 450,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "speculation": "fixed", "gamma": LONG_GAMMA,
                       "proposer": "model"}).encode()
    live.workers.wait_idle()
    before = generated_tokens(live)
    sockets = []
    for _ in range(4):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        sockets.append(sock)
    with Client(live.router, timeout_s=60) as client:
        for _ in range(3):
            done = client.generate(BACKGROUND_PROMPT, max_tokens=8, temperature=0.0,
                                   ignore_eos=True)
            assert list(done.token_ids) == expected_background[:8]
            time.sleep(0.5)
    running = live.workers.held()["num_running"]
    assert running == 4  # every stalled client's generation runs when it closes
    for sock in sockets:
        sock.close()
    freed_s = live.workers.wait_idle(timeout_s=20)
    # closing stopped them on the replica: fewer tokens than their lengths
    assert generated_tokens(live) - before < 4 * 450 + 3 * 8
    healthy(live, expected_background)
    record("http_stalled_sse_clients", streams=4, running_before_close=running,
           freed_after_close_s=round(freed_s, 2))


LONG_TOKENS = 4 * BACKGROUND_TOKENS


def test_more_streams_than_the_batch_holds_wait_and_finish(live, expected_background):
    """70 streams at once against a replica that runs 64 sequences: the batch fills, the
    rest wait in its queue, and every one finishes with the right tokens. (Far more open
    streams than that: test_regressions.py::test_a_target_full_of_streams_stays_live.)"""
    results: list = []
    loads: list[tuple[int, int]] = []  # (running, waiting) the replica reported
    go = threading.Barrier(70)

    def one() -> None:
        with Client(live.router, timeout_s=120) as client:
            client.status()  # connected before the start: arrivals spread less than a stream lives
            go.wait(timeout=60)  # all at once, so that they overlap on the replica
            # streams 4x the background's: on a loaded machine 48-token ones ended before
            # the last arrived (the batch peaked at 33 and 53 of 64)
            results.append(list(client.generate(BACKGROUND_PROMPT, max_tokens=LONG_TOKENS,
                                                temperature=0.0, ignore_eos=True).token_ids))
    threads = [threading.Thread(target=one) for _ in range(70)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        held = live.workers.held()
        loads.append((held["num_running"], held["num_waiting"]))
        time.sleep(0.005)
    assert len(results) == 70 and all(len(r) == LONG_TOKENS for r in results)
    assert all(r[:BACKGROUND_TOKENS] == expected_background for r in results)  # greedy's
    assert max(r for r, _ in loads) == MAX_NUM_SEQS  # the batch was full, never over
    assert any(r == MAX_NUM_SEQS and w > 0 for r, w in loads), max(loads)  # and others queued
    healthy(live, expected_background)
    record("overload_70_streams_64_seqs", max_waiting_seen=max(w for _, w in loads),
           failed_requests=0)
