"""Router + target + draft processes on loopback, two routers sharing one real Redis."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import grpc
import pytest
import redis
from outrider.router.auth import hash_key

from outrider.client import (
    AuthenticationError,
    Client,
    ConflictError,
    InvalidRequestError,
    OutriderError,
    PermissionDeniedError,
    RateLimitError,
    build_request,
)
from outrider.core.sampling import SamplingParams
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.launch import process_group
from outrider.state import RedisStore
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc
from outrider.v1 import state_pb2 as st
from tests.checkpoints import VOCAB

TOKEN = "cluster-token-for-router-tests"
KEY = "or-test-key-one"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def system(llama_dir, draft_dir, redis_url):
    """(router A address, router B address, target address); B knows no replica itself."""
    redis.Redis.from_url(redis_url).flushdb()
    with process_group(TOKEN, env={"OUTRIDER_API_KEYS": KEY}) as start:
        _, draft = start("draft-worker", "--model", str(draft_dir))
        _, target = start("target-worker", "--model", str(llama_dir), "--draft-address", draft,
                          "--kv-cache-mb", "8")
        _, router_a = start("router", "--model", str(llama_dir), "--target-address", target,
                            "--redis", redis_url, "--port", "0", "--http-port", "0")
        _, router_b = start("router", "--model", str(llama_dir), "--redis", redis_url,
                            "--port", "0", "--no-http")
        yield router_a, router_b, target


def client(address: str, key: str | None = KEY) -> Client:
    return Client(address, api_key=key, timeout_s=120)


def local_tokens(llama_dir, draft_dir, prompt, params: SamplingParams, gamma: int) -> list[int]:
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))))
    return decoder.generate([prompt], params, gamma)[0].output_ids


PROMPT = [5, 17, 42, 99, 3, 250, 7, 61]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_router_output_equals_single_process_loop(system, llama_dir, draft_dir, sampled):
    router_a, _, _ = system
    sampling = dict(temperature=0.8, top_p=0.9, seed=77) if sampled else dict(temperature=0.0)
    with client(router_a) as c:
        resp = c.generate(PROMPT, max_tokens=30, ignore_eos=True, speculation="fixed",
                          gamma_max=3, **sampling)
    params = SamplingParams(max_tokens=30, ignore_eos=True,
                            **{k: v for k, v in sampling.items() if k != "seed"},
                            seed=sampling.get("seed"))
    assert list(resp.token_ids) == local_tokens(llama_dir, draft_dir, PROMPT, params, 3)
    assert resp.finish_reason == "length" and resp.usage.completion_tokens == 30
    assert resp.usage.prompt_tokens == len(PROMPT)
    s = resp.speculation
    # FIXED γ = 3 every round but where the end of the request clips it
    assert s.rounds >= 8 and 0 <= s.accepted_tokens <= s.draft_tokens <= 3 * s.rounds
    assert s.draft_tokens >= 3 * (s.rounds - 3)
    assert s.mean_accepted_len == pytest.approx((s.accepted_tokens + s.rounds) / s.rounds)


def test_streaming_and_unary_agree(system):
    router_a, _, _ = system
    with client(router_a) as c:
        options = dict(max_tokens=24, temperature=0.0, speculation="auto", include_rounds=True)
        stream = c.stream("def add(a, b):", **options)
        parts = list(stream)
        streamed = stream.result()
        whole = c.generate("def add(a, b):", **options)
    assert len(parts) > 2 and streamed.finish_reason == whole.finish_reason != ""
    assert "".join(p.text for p in parts) == streamed.text == whole.text
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert streamed.usage == whole.usage  # (AUTO may choose other γ the second time, and
    # the second may look up the first's tokens: its rounds are its own)
    assert sum(len(p.rounds) for p in parts) == streamed.speculation.rounds
    assert all(r.heat >= 0 for p in parts for r in p.rounds)
    assert 0 < streamed.timings.ttft_s <= streamed.timings.total_s


def test_stop_strings_end_the_text_before_them(system, llama_dir):
    router_a, _, _ = system
    with client(router_a) as c:
        free = c.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert len(free.text) > 6
        stop = free.text[3:6]
        cut = c.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index(stop)]
    assert list(cut.token_ids) == list(free.token_ids[:len(cut.token_ids)])
    assert cut.usage.completion_tokens == len(cut.token_ids) < len(free.token_ids)


def test_two_routers_share_replicas_statistics_and_rate_limits(system, redis_url):
    router_a, router_b, target = system
    with client(router_a) as a, client(router_b) as b:
        _wait(lambda: [r.address for r in b.status().replicas] == [target])
        assert [r.address for r in a.status().replicas] == [target]
        # the shared statistics are the draft model's (§2.8): it drafts every round
        done = b.generate(PROMPT, max_tokens=12, temperature=0.0, tag="shared-stats",
                          speculation="fixed", gamma_max=2, proposer="model")
        assert done.replica == target  # B routes to the replica A registered
        stats_a = [x for x in a.status(tag="shared-stats").acceptance]
        stats_b = [x for x in b.status(tag="shared-stats").acceptance]
        assert stats_a == stats_b and len(stats_a) == 1
        assert sum(stats_a[0].tested_per_position) >= done.speculation.rounds
    limited = _cli_key(redis_url, "--name", "limited", "--rpm", "2", "--burst", "2")
    with client(router_a, limited) as a, client(router_b, limited) as b:
        a.generate(PROMPT, max_tokens=1)
        b.generate(PROMPT, max_tokens=1)
        with pytest.raises(RateLimitError) as refused:
            a.generate(PROMPT, max_tokens=1)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit" in refused.value.message
    assert 0 < refused.value.retry_after_s <= 30


def test_idempotent_request_id(system):
    router_a, router_b, _ = system
    with client(router_a) as a, client(router_b) as b:
        first = a.generate(PROMPT, max_tokens=10, temperature=1.0, request_id="idem-1")
        again = b.generate(PROMPT, max_tokens=10, temperature=1.0, request_id="idem-1")
        # the journal's answer: no second (differently seeded) sample
        assert (again.token_ids, again.text, again.speculation, again.request_id) == (
            first.token_ids, first.text, first.speculation, first.request_id)
        with pytest.raises(ConflictError) as clash:
            a.generate(PROMPT, max_tokens=11, temperature=1.0, request_id="idem-1")
    assert clash.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in clash.value.message


BAD_INPUTS = [
    (dict(prompt=""), "INVALID_ARGUMENT", "text"),
    (dict(prompt=[]), "INVALID_ARGUMENT", "token_ids"),
    (dict(prompt=[VOCAB + 5]), "INVALID_ARGUMENT", "token_ids"),
    (dict(temperature=math.nan), "INVALID_ARGUMENT", "sampling.temperature"),
    (dict(temperature=-1.0), "INVALID_ARGUMENT", "sampling.temperature"),
    (dict(top_p=1.5), "INVALID_ARGUMENT", "sampling.top_p"),
    (dict(max_tokens=0), "INVALID_ARGUMENT", "sampling.max_tokens"),
    (dict(max_tokens=10**7), "INVALID_ARGUMENT", "sampling.max_tokens"),
    (dict(seed=2**64 - 1), "INVALID_ARGUMENT", "sampling.seed"),
    (dict(stop=["x"] * 1000), "INVALID_ARGUMENT", "sampling.stop"),
    (dict(stop_token_ids=[-4]), "INVALID_ARGUMENT", "sampling.stop_token_ids"),
    (dict(request_id="bad id with spaces"), "INVALID_ARGUMENT", "request_id"),
    (dict(tag="no/slashes"), "INVALID_ARGUMENT", "tag"),
    (dict(gamma_max=99), "INVALID_ARGUMENT", "speculation.gamma_max"),
    (dict(proposer="bigram"), "INVALID_ARGUMENT", "proposer"),
    (dict(tree_tokens=64), "INVALID_ARGUMENT", "speculation.tree_tokens"),
    # (the replica's: it verifies chains)
    (dict(tree_topk=2), "INVALID_ARGUMENT", "tree_topk 2, tree_tokens 0: the replica"),
    (dict(prompt=[7] * 5000), "INVALID_ARGUMENT", "prompt"),  # longer than the context
]


@pytest.mark.parametrize("fields,code,named", BAD_INPUTS,
                         ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_its_status_and_names_the_field(system, fields, code, named):
    router_a, _, _ = system
    fields = dict(fields)
    prompt = fields.pop("prompt", PROMPT)
    with client(router_a) as c, pytest.raises(InvalidRequestError) as err:
        c.generate(prompt, **{"max_tokens": 4, **fields})
    assert err.value.code.name == code
    assert named in err.value.message


def test_a_request_chooses_what_proposes_and_greedy_output_stays_the_targets(system):
    """DESIGN §2.8: the per-request proposer reaches the replica; each kind proposes only
    its own tokens (AUTO: the suffix lookup and the draft model); the text is the same."""
    router_a, _, _ = system
    allowed = {"model": {"draft_model"}, "ngram": {"ngram"}, "suffix": {"suffix"},
               "auto": {"suffix", "draft_model"}}
    with client(router_a) as c:
        results = {kind: c.generate(PROMPT, max_tokens=48, temperature=0.0, ignore_eos=True,
                                    speculation="fixed", gamma_max=4, proposer=kind,
                                    include_rounds=True) for kind in allowed}
    assert len({r.token_ids for r in results.values()}) == 1
    for kind, r in results.items():
        assert set(r.speculation.by_proposer) <= allowed[kind], (kind, r.speculation)
        assert sum(d for d, _ in r.speculation.by_proposer.values()) == r.speculation.draft_tokens
        assert sum(x.num_free for x in r.rounds) == sum(
            r.speculation.by_proposer.get(k, (0, 0))[0] for k in ("ngram", "suffix"))
    assert results["model"].speculation.by_proposer["draft_model"][0] > 0


def test_unknown_speculation_mode_and_missing_prompt(system):
    router_a, _, _ = system
    with grpc.insecure_channel(router_a) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        bad_mode = build_request(PROMPT)
        bad_mode.speculation.mode = 7
        for req, named in ((bad_mode, "speculation.mode"), (gp.GenerateRequest(), "prompt")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert named in err.value.details()


def test_keys_are_required_and_checked(system, redis_url):
    router_a, _, _ = system
    store = RedisStore(redis_url)
    store.put_api_key(hash_key("or-off"), st.ApiKeyRecord(name="off", disabled=True))
    code_only = _cli_key(redis_url, "--name", "code-only", "--tag", "code")
    cases = [(None, "UNAUTHENTICATED", "missing API key"), ("or-wrong", "UNAUTHENTICATED", ""),
             ("or-off", "PERMISSION_DENIED", "disabled"),
             (code_only, "PERMISSION_DENIED", "tag")]
    for key, code, words in cases:
        with client(router_a, key) as c, pytest.raises(OutriderError) as err:
            c.generate(PROMPT, max_tokens=2, tag="chat")
        assert err.value.code.name == code and words in err.value.message
        assert isinstance(err.value, AuthenticationError if code == "UNAUTHENTICATED"
                          else PermissionDeniedError)
    with client(router_a, code_only) as c:
        assert c.generate(PROMPT, max_tokens=2, tag="code").usage.completion_tokens == 2
    assert store.api_key(hash_key(KEY)) is not None  # stored by its hash ...
    assert not [k for k in redis.Redis.from_url(redis_url).keys("*") if KEY.encode() in k]


def _cli_key(redis_url: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "outrider.cli", "keys", "create", "--redis",
                          redis_url, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _wait(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
