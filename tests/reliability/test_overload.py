"""The router under hostile load (docs/RELIABILITY.md, "Overload and slow clients"): bad
text is a 400, admission holds on HTTP and gRPC alike, slow or huge requests are bounded
(clients that stop reading: test_stalled_readers.py). Small limits make each bound
reachable with a handful of requests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outrider import paths
from outrider.client import Client, RateLimitError
from outrider.launch import free_port, outrider_process
from outrider.local_system import LocalSystemConfig, local_system
from tests.processes import listening_pid
from tests.reliability._support import record, rss_kb, wait_until
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

MAX_RUNNING, MAX_QUEUED, HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 2, 2, 2.0, 2.0
ROUTER_ARGS = ("--max-running-requests", str(MAX_RUNNING),
               "--max-queued-requests", str(MAX_QUEUED), "--max-queue-wait", "2",
               "--max-prompts-per-request", "4", "--http-header-timeout", str(HEADER_TIMEOUT_S),
               "--http-body-timeout", str(BODY_TIMEOUT_S), "--max-body-mb", "1",
               "--strict-openai-fields")
MODEL = "demo-target"
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def system():
    cfg = LocalSystemConfig(str(paths.demo_target_dir()), str(paths.demo_draft_dir()),
                            grpc_port=0, http_port=0, extra_router_args=ROUTER_ARGS,
                            metrics=True)
    with local_system(cfg) as running:
        yield running


def post(system, path: str, body: bytes | dict, timeout: float = 120):
    """(status, headers, parsed JSON body) of a POST, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{system.http}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def completion(system, **fields):
    return post(system, "/v1/completions", {"model": MODEL, "prompt": "def f(x):", **fields})


# -- bad text ------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model": "demo-target", "messages": [{"role": "user", '
                             '"content": "x\\udfff"}]}', "messages"),
    ("/v1/completions", '{"model": "demo-target", "prompt": "x\\ud800y"}', "prompt"),
    ("/v1/completions", '{"model": "demo-target", "prompt": "x", "stop": ["\\udfff"]}', "stop"),
    ("/v1/completions", '{"model": "demo-target", "prompt": "x", "user": "\\udc00"}', "user"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(system, path, body, param):
    status, _, answer = post(system, path, body.encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert "lone surrogate" in answer["error"]["message"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(st.characters(codec=None, exclude_categories=()), min_size=1,
                    max_size=12))
def test_any_text_in_a_chat_message_is_answered_without_a_5xx(system, text):
    body = {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": text}]}
    status, _, answer = post(system, "/v1/chat/completions",
                             json.dumps(body, ensure_ascii=True).encode())
    assert status in (200, 400), answer


def test_a_strict_router_refuses_unknown_fields_naming_the_first(system):
    status, _, answer = completion(system, max_tokens=1, zz_unknown=1, bogus=2)
    assert status == 400 and answer["error"]["param"] == "bogus"
    assert "unknown field" in answer["error"]["message"]
    status, _, _ = completion(system, max_tokens=1, guided_choice=["a"])  # known: served
    assert status == 200


# -- admission -----------------------------------------------------------------------------
def test_beyond_running_and_queued_requests_are_refused_and_the_admitted_served(system):
    results = []

    def one():
        results.append(completion(system, **{**LONG, "max_tokens": 300}))
    threads = [threading.Thread(target=one) for _ in range(3 * (MAX_RUNNING + MAX_QUEUED))]
    for t in threads:
        t.start()
    admitted, running = [], []  # the router's admission slots held; the replica's sequences
    deadline = time.monotonic() + 180
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        admitted.append(total(scrape(system.http), "outrider_router_generations_running"))
        running.append(total(scrape(system.metrics["target"]), "vllm:num_requests_running"))
        time.sleep(0.02)
    assert not any(t.is_alive() for t in threads)
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served) + len(refused) == len(threads), [r[0] for r in results]
    # the router held its limit, and the replica (its own gauge) ran as many, no more
    assert max(admitted) == MAX_RUNNING and max(running) == MAX_RUNNING, (admitted, running)
    assert len(served) >= MAX_RUNNING and refused
    assert all(r[2]["usage"]["completion_tokens"] == 300 for r in served)
    assert all(int(r[1]["Retry-After"]) >= 1 for r in refused)


def test_grpc_is_refused_while_http_fills_the_router(system):
    holders = [threading.Thread(target=completion, args=(system,), kwargs=LONG)
               for _ in range(MAX_RUNNING + MAX_QUEUED)]
    for t in holders:
        t.start()
    with Client(system.router, timeout_s=60, retry=None) as client:
        deadline = time.monotonic() + 30
        with pytest.raises(RateLimitError):  # RESOURCE_EXHAUSTED, once the slots are taken
            while time.monotonic() < deadline:
                client.generate("def g(y):", max_tokens=1)
                time.sleep(0.05)
    for t in holders:
        t.join(180)


def test_a_request_counts_its_prompts_and_their_number_is_bounded(system):
    status, _, answer = completion(system, prompt=["a", "b", "c"], max_tokens=1)
    assert status == 400 and "asks for 3 generations" in answer["error"]["message"]
    status, _, answer = completion(system, prompt=["a"] * 5, max_tokens=1)
    assert status == 400 and answer["error"]["param"] == "prompt"


# -- slow and large requests ---------------------------------------------------------------
def _raw(system, receive_buffer: int | None = None) -> socket.socket:
    host, port = system.http.rsplit(":", 1)
    sock = socket.socket()
    if receive_buffer:  # before connecting: the window it advertises is set then
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def _closed_after(sock: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closes the connection, and what it sent before."""
    start, received = time.monotonic(), b""
    while chunk := sock.recv(65536):
        received += chunk
    return time.monotonic() - start, received


def test_headers_that_never_complete_are_closed_within_the_bound(system):
    with _raw(system) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        waited, received = _closed_after(sock)
    assert received == b"" and waited < HEADER_TIMEOUT_S + 3


def test_a_body_that_never_completes_is_a_408_and_closed(system):
    with _raw(system) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        waited, received = _closed_after(sock)
    assert received.startswith(b"HTTP/1.1 408") and waited < BODY_TIMEOUT_S + 3


def test_a_body_over_the_limit_is_refused_unread(system):
    with _raw(system) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 5000000\r\n\r\n")
        waited, received = _closed_after(sock)
    assert received.startswith(b"HTTP/1.1 413") and waited < 5


# -- memory --------------------------------------------------------------------------------
def test_router_memory_returns_after_a_burst_of_large_refused_requests():
    """Bodies of 5 MB prompts and 100,000-entry logit_bias maps, all rightly refused (400),
    four at a time, in two waves of 32: the router's RSS stays within 1.5x of what it was
    before."""
    cfg = LocalSystemConfig(str(paths.demo_target_dir()), None, grpc_port=0, http_port=0)
    big = {"model": MODEL, "prompt": "x" * 5_000_000, "max_tokens": 1}
    bias = {"model": MODEL, "prompt": "x", "max_tokens": 1,
            "logit_bias": {str(i): 1 for i in range(100_000)}}
    bodies = [json.dumps(b).encode() for b in (big, bias)]
    with local_system(cfg) as system:
        pid = listening_pid(int(system.http.rsplit(":", 1)[1]))
        completion(system, max_tokens=4)
        baseline = rss_kb(pid)
        statuses = []

        def burst():
            statuses.extend(post(system, "/v1/completions", b)[0] for _ in range(4)
                            for b in bodies)
        for _ in range(2):
            threads = [threading.Thread(target=burst) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        # the last requests' memory is returned just after their answers
        with contextlib.suppress(AssertionError):  # judged below, with the figures
            wait_until(lambda: rss_kb(pid) <= 1.5 * baseline, timeout_s=10)
        after = rss_kb(pid)
    record("router_rss_after_large_refusals", baseline_kb=baseline, after_kb=after)
    assert statuses == [400] * 64
    assert after <= 1.5 * baseline, f"{baseline} KiB before, {after} KiB after"


# -- a router that stops -------------------------------------------------------------------
def test_http_streams_end_with_an_error_event_when_their_router_stops():
    cfg = LocalSystemConfig(str(paths.demo_target_dir()), None, grpc_port=0, http_port=0)
    body = json.dumps({"model": MODEL, "prompt": "import os\n", "stream": True,
                       **LONG, "max_tokens": 1900}).encode()
    with local_system(cfg) as system, _raw(system) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        head = b""
        while b"data: {" not in head:  # streaming
            head += sock.recv(65536)
        os.kill(listening_pid(int(system.http.rsplit(":", 1)[1])), signal.SIGTERM)
        _, received = _closed_after(sock)
    events = [line for line in (head + received).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert b"the router is shutting down" in events[-2]


# -- health --------------------------------------------------------------------------------
def _health(http: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{http}/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_health_says_whether_a_replica_can_serve(system):
    assert _health(system.http) == (200, {"status": "ok", "live_replicas": 1})
    http_port = free_port()
    with outrider_process("router", "--model", str(paths.demo_target_dir()), "--port", "0",
                          "--http-port", str(http_port)):
        assert _health(f"127.0.0.1:{http_port}") == (503, {"status": "degraded",
                                                           "live_replicas": 0})
