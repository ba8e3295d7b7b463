"""Regression tests for bugs the reliability work found and that were fixed
while it went on (docs/RELIABILITY.md, "Findings"). Each failed on the code before its
fix; the docstring says what was wrong. Findings 9 and 10 were open (strict expected
failures) until the router got journal claims with leases and a running-request limit.
Two more live in other files:
seeded sampling that changed with the load
(test_failures.py::test_seeded_sampling_resumed_after_target_kill_reproduces_the_run, whose
concurrent streams must equal their solo runs) and a frozen Redis stalling every stream
(test_failures.py::test_redis_frozen_neither_fails_nor_stalls_requests)."""

from __future__ import annotations

import gc
import json
import time
import tracemalloc

import grpc
import pytest
import requests

from outrider.client import Client, ConflictError
from outrider.launch import free_port, process_group
from outrider.state import MemoryStore
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc
from outrider.v1 import state_pb2 as st
from tests.reliability._support import RedisServer, record, reference_greedy, wait_until

TOKEN = "reliability-regressions-token"


def test_memory_store_forgets_expired_journals():
    """Was: a router without Redis kept every request's journal (record, tokens,
    serialized response) in MemoryStore after its TTL: 6.3 MB for 5,000 64-token
    requests, forever (router/state.py, now outrider/state/memory.py; fixed by sweeping
    expired entries)."""
    store = MemoryStore()
    record = st.JournalRecord(fingerprint="f" * 64, prompt_ids=list(range(20)))
    finished = st.JournalRecord(fingerprint="f" * 64, prompt_ids=list(range(20)),
                                is_finished=True, response=b"r" * 400)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            store.journal_start(f"req-{i}", record, ttl_s=0.01, lease_s=0.01)
            store.journal_append(f"req-{i}", list(range(64)), ttl_s=0.01)
            store.journal_finish(f"req-{i}", finished, ttl_s=0.01)
        time.sleep(0.05)
        assert store.journal("req-0") is None  # expired ...
        store.journal_start("one-more", record, ttl_s=60, lease_s=60)  # (a chance to sweep)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 500_000, f"{held / 1e6:.1f} MB still held for 5,000 expired journals"


@pytest.mark.slow
def test_configured_api_keys_survive_a_redis_restart(llama_dir, tmp_path):
    """Was: keys from OUTRIDER_API_KEYS lived only in the shared store (written once at
    router start, cached 30 s), so after Redis restarted without its data a configured
    key was refused UNAUTHENTICATED (at once if unused for 30 s) until the router
    restarted (router/auth.py; fixed by keeping the router's own keys in process)."""
    redis_server = RedisServer(free_port(), tmp_path).start()
    try:
        with process_group(TOKEN, env={"OUTRIDER_API_KEYS": "or-used-key,or-idle-key"}) as start:
            _, router = start("router", "--model", str(llama_dir), "--redis", redis_server.url,
                              "--port", "0", "--no-http")
            with Client(router, api_key="or-used-key", timeout_s=30) as used:
                assert used.status().is_store_reachable
                redis_server.kill()
                redis_server.start()  # the same port, no data
                wait_until(lambda: used.status().is_store_reachable, 15)
            with Client(router, api_key="or-idle-key", timeout_s=30, retry=None) as idle:
                assert idle.status().is_store_reachable
    finally:
        redis_server.kill()


@pytest.fixture(scope="module")
def lone_router(llama_dir):
    """A router with no replica: refusals at parsing and validation need none. Strict
    about unknown fields, so that their refusals are here to name them."""
    http_port = free_port()
    with process_group(TOKEN) as start:
        _, router = start("router", "--model", str(llama_dir), "--port", "0", "--http-port",
                          str(http_port), "--strict-openai-fields")
        yield router, f"http://127.0.0.1:{http_port}", llama_dir.name


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    b"\x0a\x03\xff\xfeA",                                   # text: invalid UTF-8
    gp.GenerateRequest(text="hi").SerializeToString() + b"\x32\x02\xc3\x28",  # tag
    gp.GenerateRequest(text="hello", tag="x").SerializeToString()[:-1],  # truncated
    b"\xff\xff\xff\xff"], ids=["utf8-text", "utf8-tag", "truncated", "garbage"])
def test_unparsable_requests_get_invalid_argument(lone_router, body):
    """Was: gRPC Python's own INTERNAL "Exception deserializing request!" (a server
    fault to clients and to outrider_requests_total{code}); fixed by StrictParsing in
    outrider/grpc_server.py."""
    router, _, _ = lone_router
    with grpc.insecure_channel(router) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/outrider.v1.Generation/Generate")(body, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


@pytest.mark.slow
@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": "\xff\xfe"}',
                                  b"[" * 100_000 + b"]" * 100_000],
                         ids=["invalid-utf8", "nested-100000-deep"])
def test_undecodable_http_bodies_get_openai_errors(lone_router, body):
    """Was: FastAPI's {"detail": "There was an error parsing the body"} (400), which
    OpenAI clients cannot read (router/http_api.py; fixed by a handler for starlette's
    HTTPException)."""
    _, http, _ = lone_router
    response = requests.post(f"{http}/v1/completions", data=body, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json().get("error", {}).get("type") == "invalid_request_error", \
        response.text


@pytest.mark.slow
@pytest.mark.parametrize("extra,param", [({"topP": 0.5}, "topP"),
                                         ({"Max_Tokens": 4}, "Max_Tokens"),
                                         ({"max-tokens": 4}, "max-tokens"),
                                         ({"prompt": [2**40]}, "prompt"),
                                         ({"stop_token_ids": [2**40]}, "stop_token_ids")])
def test_http_errors_name_the_parameter(lone_router, extra, param):
    """Was: `param: null` for unknown fields not in lower snake case and for token ids
    beyond int32 ("Value out of range: 1099511627776"): the field was parsed back out
    of the message with [a-z_]+ (router/openai_protocol.py http_field); fixed by
    carrying the field in Refused."""
    _, http, model = lone_router
    body = {"model": model, "prompt": "x", "max_tokens": 2, **extra}
    response = requests.post(f"{http}/v1/completions", data=json.dumps(body), timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.slow
def test_a_target_full_of_streams_stays_live(llama_dir):
    """Was: the target's gRPC pool had max_num_seqs + 16 threads and every open stream,
    waiting ones too, held one; past that, GetLoad heartbeats timed out, the router
    dropped the healthy replica and new requests failed UNAVAILABLE "no target replica
    is available" (100 streams with the defaults; target_worker/main.py; fixed by room
    for the router's queue). 30 streams against max_num_seqs 4 here."""
    request = gp.GenerateRequest(token_ids=gp.TokenIds(ids=[5, 6, 7]),
                                 sampling=gp.SamplingOptions(max_tokens=400, temperature=0.0,
                                                             ignore_eos=True))
    with process_group(TOKEN) as start:
        _, target = start("target-worker", "--model", str(llama_dir), "--max-num-seqs", "4")
        _, router = start("router", "--model", str(llama_dir), "--target-address", target,
                          "--port", "0", "--no-http")
        with grpc.insecure_channel(router) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            streams = [stub.GenerateStream(request, timeout=120) for _ in range(30)]
            try:
                time.sleep(4)  # heartbeats every 0.5 s, each allowed 1 s
                with Client(router, timeout_s=60) as client:
                    replicas = [r.address for r in client.status().replicas]
                    assert replicas == [target]
                    done = client.generate([5, 6, 7], max_tokens=2, temperature=0.0)
                assert done.usage.completion_tokens == 2
            finally:
                for s in streams:
                    s.cancel()


@pytest.mark.slow
def test_a_request_id_is_usable_again_after_its_router_crashed(llama_dir, tmp_path):
    """Was (finding 9): a router SIGKILLed mid-stream never closed its request's journal
    in Redis, so a retry with the same request id (the idempotency key) got ALREADY_EXISTS
    "still running" from every router for the journal's TTL, 600 s, although nothing ran
    it (router/service.py _open_journal; fixed by claims with a 5 s lease that the running
    router renews, router/claims.py). The retry runs the request afresh."""
    redis_server = RedisServer(free_port(), tmp_path).start()
    port = free_port()
    router_args = ("router", "--model", str(llama_dir), "--redis", redis_server.url,
                   "--port", str(port), "--no-http")
    options = dict(max_tokens=120, temperature=0.0, ignore_eos=True, request_id="crash-1")
    try:
        with process_group(TOKEN) as start:
            _, target = start("target-worker", "--model", str(llama_dir))
            router_proc, router = start(*router_args, "--target-address", target)
            with Client(router, timeout_s=60) as client:
                next(iter(client.stream([5, 6, 7], **options)))
                router_proc.kill()  # SIGKILL: no goodbye
                router_proc.wait()
            killed_at = time.monotonic()
            _, router = start(*router_args, "--target-address", target)
            with Client(router, timeout_s=60) as client:
                def retry():
                    try:
                        retry.result = client.generate([5, 6, 7], **options)
                        return True
                    except ConflictError:  # the dead router's claim has not lapsed yet
                        return False
                wait_until(retry, timeout_s=30, interval_s=0.5)
        free_after_s = time.monotonic() - killed_at
        record("request_id_free_after_router_kill", seconds=round(free_after_s, 2))
        assert list(retry.result.token_ids) == reference_greedy(llama_dir, [[5, 6, 7]], 120)[0]
    finally:
        redis_server.kill()


@pytest.mark.slow
def test_a_router_at_its_limit_refuses_more_and_stays_answerable(llama_dir):
    """Was (finding 10): the router served gRPC from one pool of 128 threads and every
    open stream held one; with 140 streams open, health checks, Status and new requests
    all waited in gRPC's queue until their deadlines, and a liveness probe would have
    restarted the router (router/main.py; fixed by a running-request limit with spare
    threads for the rest). Here 140 streams meet a limit of 100: 40 are refused at once
    with RESOURCE_EXHAUSTED and a retry hint, over gRPC and HTTP alike, while health and
    Status answer; once streams end, requests run again."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = gp.GenerateRequest(token_ids=gp.TokenIds(ids=[5, 6, 7]),
                                 sampling=gp.SamplingOptions(max_tokens=400, temperature=0.0,
                                                             ignore_eos=True))
    with process_group(TOKEN) as start:
        _, target = start("target-worker", "--model", str(llama_dir), "--max-num-seqs", "4")
        http_port = free_port()  # (just before the router binds it)
        _, router = start("router", "--model", str(llama_dir), "--target-address", target,
                          "--port", "0", "--http-port", str(http_port),
                          "--max-running-requests", "100", "--max-queued-requests", "0")
        with grpc.insecure_channel(router) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            streams = [stub.GenerateStream(request, timeout=120) for _ in range(140)]
            try:
                wait_until(lambda: sum(s.done() for s in streams) >= 40, timeout_s=20)
                refused = [s for s in streams if s.done()]
                assert len(refused) == 40
                for s in refused:
                    assert s.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, s.details()
                    assert "retry-after-ms" in dict(s.trailing_metadata())
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                with Client(router, timeout_s=5) as client:
                    assert [r.address for r in client.status().replicas] == [target]
                over_http = requests.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                          json={"model": llama_dir.name, "prompt": "hi",
                                                "max_tokens": 2}, timeout=10)
                assert over_http.status_code == 429 and "Retry-After" in over_http.headers
            finally:
                for s in streams:
                    s.cancel()
        with Client(router, timeout_s=60) as client:
            def runs_again():
                try:
                    return client.generate([5, 6, 7], max_tokens=2).usage.completion_tokens == 2
                except Exception:  # noqa: BLE001 - slots free as the cancels arrive
                    return False
            wait_until(runs_again, timeout_s=30, interval_s=0.5)
