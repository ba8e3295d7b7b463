"""Clients that stop reading stop costing tokens within seconds, however many of them
(docs/RELIABILITY.md, "Overload and slow clients"): 48 streams whose clients read
nothing, measured on the target's own generated-tokens counter; a client that reads one
event a second is never cancelled."""

from __future__ import annotations

import json
import socket
import time

import pytest
from outrider.router.target_link import UNREAD, UNREAD_TIMEOUT_S

from outrider import paths
from outrider.local_system import LocalSystemConfig, local_system
from tests.reliability._support import queued_bytes, record
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

STALLED = 48
GIVE_UP_S = 60.0  # the 48 buffers fill in ~2 s on an idle 2-core machine
WINDOW_S = 3.0    # watched after the last cancel
MARGIN_S = 3.0    # beyond the bound: a loaded machine's late check and scrape
IN_FLIGHT_TOKENS = 16  # a sequence's tokens of steps already running when it is cancelled
ROUTER_ARGS = ("--max-running-requests", str(STALLED), "--max-queued-requests", "16")
MODEL = "demo-target"


@pytest.fixture(scope="module")
def system():
    cfg = LocalSystemConfig(str(paths.demo_target_dir()), str(paths.demo_draft_dir()),
                            grpc_port=0, http_port=0, extra_router_args=ROUTER_ARGS,
                            metrics=True)
    with local_system(cfg) as running:
        yield running


def open_stream(system, receive_buffer: int, **fields) -> socket.socket:
    """A streamed completion over a raw socket whose receive buffer is `receive_buffer`
    bytes, sent and not read."""
    body = json.dumps({"model": MODEL, "prompt": "import os\n", "stream": True,
                       "ignore_eos": True, "temperature": 0, **fields}).encode()
    host, port = system.http.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect
    sock.settimeout(60)
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    return sock


def target_tokens(system) -> float:
    """What the target replica has generated so far (its own counter, not the router's)."""
    return total(scrape(system.metrics["target"]), "vllm:generation_tokens_total")


def unread(system) -> float:
    return total(scrape(system.http), "outrider_router_streams_unread_total")


def read_to_end(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def events(received: bytes) -> list[dict]:
    """The whole events received (a reader that stopped may hold half of the next)."""
    whole = received.rsplit(b"\n\n", 1)[0]
    return [json.loads(line[6:]) for line in whole.split(b"\n") if line.startswith(b"data: {")]


def test_many_stalled_readers_stop_costing_tokens_within_seconds(system):
    """48 at once, each a 2,000-token stream behind a 4 KiB receive buffer: more work than
    the target does in a minute. Each is cancelled within the bound (plus a loaded
    machine's margin) of the moment its client's buffer stopped taking bytes, however
    long the target took to fill them all, and the target then generates nothing for them."""
    before = unread(system)
    socks = [open_stream(system, 4096, max_tokens=2000) for _ in range(STALLED)]
    try:
        start, first_count = time.monotonic(), target_tokens(system)
        queued, last_growth = [0] * STALLED, [start] * STALLED
        while unread(system) - before < STALLED and time.monotonic() < start + GIVE_UP_S:
            for i, sock in enumerate(socks):
                if (now_queued := queued_bytes(sock)) > queued[i]:
                    queued[i], last_growth[i] = now_queued, time.monotonic()
            time.sleep(0.25)
        all_cancelled = time.monotonic()
        cancelled_count = target_tokens(system)
        time.sleep(WINDOW_S)
        after = target_tokens(system) - cancelled_count
        lag = all_cancelled - max(last_growth)
        record("stalled_readers", readers=STALLED, tokens_before=cancelled_count - first_count,
               tokens_after=after, all_cancelled_s=all_cancelled - start, lag_s=lag)
        assert unread(system) - before == STALLED, f"not all cancelled in {GIVE_UP_S} s"
        assert min(queued) > 0, queued
        assert lag <= UNREAD_TIMEOUT_S + MARGIN_S, lag
        assert after <= STALLED * IN_FLIGHT_TOKENS, (
            f"the target generated {after:.0f} tokens in the {WINDOW_S:g} s after the "
            f"readers that read nothing were cancelled")
        received = read_to_end(socks[0])  # read now: the stream ends with the reason
    finally:
        for sock in socks:
            sock.close()
    last = [e for e in events(received) if "error" in e][-1]
    assert UNREAD in last["error"]["message"]


def test_a_reader_that_reads_one_event_a_second_is_never_cancelled(system):
    """Events of ~2 KB (20 logprobs a token) against a 4 KiB receive buffer: the buffers
    between the engine and the client are full within a second, and stay full; the reader
    takes about one event a second for three times the bound, then reads the rest: the
    stream ends at its length, not with an error (which would come after what was
    buffered)."""
    before, received = unread(system), b""
    # ~0.8 MB of events, far more than the buffers between hold: they stay full throughout
    with open_stream(system, 4096, max_tokens=1000, logprobs=20) as sock:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            received += sock.recv(2048)
            time.sleep(1.0)
        slow_tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events(received))
        received += read_to_end(sock)
    seen = events(received)
    assert not any("error" in e for e in seen), seen[-1:]
    # a round's tokens travel in one event: count tokens, not events
    assert slow_tokens >= 10, seen[-1:]
    assert seen[-1]["choices"][0]["finish_reason"] == "length", seen[-1:]
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in seen) == 1000
    assert unread(system) == before
