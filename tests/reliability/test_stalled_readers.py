"""Clients that stop reading stop costing tokens within seconds, however many of them
(docs/RELIABILITY.md, "Overload and slow clients"): 48 streams whose clients read
nothing, measured on the target's own generated-tokens counter; a client that reads one
event a second is never cancelled."""

from __future__ import annotations

import json
import socket
import time

import pytest
from outrider.router.target_link import UNREAD

from outrider import paths
from outrider.local_system import LocalSystemConfig, local_system
from tests.reliability._support import record
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

STALLED = 48
WINDOW_S = 10.0  # the test compares the target's tokens over two such windows
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
    the target does in 20 s, so tokens after the first 10 s are tokens nobody reads."""
    before = unread(system)
    socks = [open_stream(system, 4096, max_tokens=2000) for _ in range(STALLED)]
    try:
        start, counts, all_cancelled_s = time.monotonic(), [target_tokens(system)], None
        for window in (1, 2):
            while (now := time.monotonic()) < start + window * WINDOW_S:
                if all_cancelled_s is None and unread(system) - before >= STALLED:
                    all_cancelled_s = now - start
                time.sleep(0.5)
            counts.append(target_tokens(system))
        first, second = counts[1] - counts[0], counts[2] - counts[1]
        record("stalled_readers", readers=STALLED, tokens_0_10s=first, tokens_10_20s=second,
               all_cancelled_s=all_cancelled_s)
        assert first > 0, counts
        # the bound is 5 s once a buffer is full: 10 s leaves a loaded machine its margin
        assert all_cancelled_s is not None and all_cancelled_s <= WINDOW_S, all_cancelled_s
        assert second <= 0.25 * first, (f"the target generated {second:.0f} tokens in "
                                        f"seconds 10-20 for readers that read nothing, "
                                        f"against {first:.0f} in seconds 0-10")
        assert unread(system) - before == STALLED
        received = read_to_end(socks[0])  # read now: the stream ends with the reason
    finally:
        for sock in socks:
            sock.close()
    last = [e for e in events(received) if "error" in e][-1]
    assert UNREAD in last["error"]["message"]


def test_a_reader_that_reads_one_event_a_second_is_never_cancelled(system):
    """Events of ~2 KB (20 logprobs a token) against a 4 KiB receive buffer: the buffers
    between the engine and the client are full within a second, and stay full; the reader
    takes about one event a second for three times the bound."""
    before, received = unread(system), b""
    with open_stream(system, 4096, max_tokens=2000, logprobs=20) as sock:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            received += sock.recv(2048)
            time.sleep(1.0)
    seen = events(received)
    assert len(seen) >= 10 and not any("error" in e for e in seen), seen[-1:]
    assert unread(system) == before
