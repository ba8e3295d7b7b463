"""Load and soak: many concurrent streams through router + target + draft for
a bounded time, then the processes must hold nothing and must not have grown.

    OUTRIDER_SOAK_S=90 OUTRIDER_SOAK_STREAMS=32 .venv/bin/python -m pytest -s \
        tests/reliability/test_soak.py

Each stream loops over a mix: greedy gRPC streams (AUTO, FIXED or OFF; tokens checked
against the target's own greedy output), seeded sampling, clients that leave after the
first message, OpenAI-style HTTP streams (text checked), unary calls and requests the
router refuses. Beside them, a few HTTP clients stop reading their stream at the start
(more with OUTRIDER_SOAK_STALLED=1): the router must cancel each as unread
(backpressure). Zero errors; the resident memory (VmRSS) of the router, target and
draft does not climb after the warm-up (its trend stays under a bound a minute) nor
jump (< 10 % from the end of the warm-up to the end of the run); afterwards every KV
block is free, no sequence runs or waits and the draft holds no sequence."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import statistics
import threading
import time
from collections import Counter

import pytest
import requests
from outrider.router.target_link import UNREAD, UNREAD_TIMEOUT_S

from outrider.client import Client, InvalidRequestError
from outrider.core.tokenizer import Tokenizer
from outrider.launch import free_port, process_group
from tests.checkpoints import edit_config
from tests.reliability._support import (
    RedisServer,
    Workers,
    queued_bytes,
    record,
    reference_greedy,
    rss_kb,
)

pytestmark = pytest.mark.slow

# 120 s in CI: growth is measured from 60 s, as the long soaks measure it, past the
# target's first-minute fill (a 45 s run measured from 15 s: the target grew 4.5-6.0 %;
# a 90 s run measured from 30 s: 1.5-2.7 % alone, and 5.5 % once inside the whole suite)
SOAK_S = float(os.environ.get("OUTRIDER_SOAK_S", "120"))
STREAMS = int(os.environ.get("OUTRIDER_SOAK_STREAMS", "32"))
# the router's store in a Redis of the test's own (OUTRIDER_SOAK_REDIS=0: in the router).
# Without Redis the router keeps each request's journal in memory for journal_ttl_s
# (600 s) by design, so its memory rises for ten minutes and a long soak could not tell
# that from a leak.
WITH_REDIS = os.environ.get("OUTRIDER_SOAK_REDIS", "1") != "0"
# HTTP clients that stop reading: STALLED_CLIENTS at the start, within the warm-up (their
# 500-token logprob streams raise the target's memory for a while: in the mix of a 45 s
# run they passed the 5 % bound, docs/RELIABILITY.md); with OUTRIDER_SOAK_STALLED=1 also
# 4 % of the mix's requests
STALLED = 4 if os.environ.get("OUTRIDER_SOAK_STALLED", "0") != "0" else 0
STALLED_CLIENTS = 3
# caches fill (prefix index, KV block hashes, allocator pools) for about a minute at 64
# streams: growth is measured after half the run, at most a minute
WARMUP_S = min(60.0, SOAK_S / 2)
# Memory after the warm-up is judged two ways. A leak climbs, and stays up: the rates a
# process grew at between each sample and the one TREND_LAG_S later (10 s in CI), at their
# 40th percentile (the rate it kept up over 60 % of the window), and the rate from the
# window's first TREND_LAG_S to its last; the smaller stays under MAX_TREND_MB_PER_MIN.
# A step (an allocator taking a new chunk, a pool starting threads) lifts only the pairs
# that straddle it, a fifth, and the percentile barely moves: CI's router once rose
# 130 -> 137 MB in one step after 90 s and, measured the old way (end against warm-up),
# failed a 5 % bound that a steady 1 MB per 15 s (3 %) would have passed. A rise that fell
# back is no leak either (beside a whole suite and three busy processes, load 17, the
# router rose 118 -> 125 MB over a minute and ended at 122, below the warm-up). In four 120 s,
# 32-stream soaks (two alone, two beside three busy processes), MB a minute: router at
# most 0.0 as run, 1.4 with a 7.3 MB step added at any second, at least 3.5 with 1 MB per
# 15 s added; draft 1.1 / 1.7 / 4.7. The target grows natively for minutes (oneDNN and
# torch on glibc, docs/RELIABILITY.md): up to 5.7 as run, 11.1 with the step, so only a
# faster climb fails it. A jump: the end's median against the warm-up's, under MAX_GROWTH.
TREND_LAG_S = (SOAK_S - WARMUP_S) / 6
MAX_TREND_MB_PER_MIN = {"router": 2.5, "draft": 2.5, "target": 20.0}
MAX_GROWTH = 0.10
TOKEN = "reliability-soak-token"
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 61], [11, 12, 13, 14], [200, 2, 9, 77, 41],
           [31, 41, 59, 26, 53, 58, 97], [8, 6, 7, 5, 3, 0, 9], [120, 121, 122],
           [1, 100, 10, 100], [64, 128, 192, 256]]
MAX_TOKENS = 64
# the served copy's context, longer than the test checkpoints' 512 (tests/checkpoints.py) so
# that a stalled client's stream outlasts the unread bound at any pace: a 500-token one,
# generated in under 5 s on a quiet machine, was served whole into the buffers and ended
# by length before the router could see its client had read nothing
CONTEXT = 4096


def _wait_unread(sock: socket.socket, limit_s: float = 120.0) -> None:
    """Read nothing until the router must have seen it: what waits in the socket's receive
    queue (FIONREAD, not read) stayed the same for longer than the unread bound, so the
    queue is full and the router's bytes wait. A fixed sleep from connecting was paced by
    the machine: on a loaded one the queue was not full yet when it ended, and the stream
    was read whole (CI, twice)."""
    queued, since = -1, time.monotonic()
    deadline = since + limit_s
    while time.monotonic() < deadline:
        now_queued = queued_bytes(sock)
        if now_queued != queued or now_queued == 0:
            queued, since = now_queued, time.monotonic()
        elif time.monotonic() - since > UNREAD_TIMEOUT_S + 3:
            return
        time.sleep(0.25)
    raise AssertionError(f"stalled: the receive queue never filled in {limit_s} s")


class Soak:
    def __init__(self, router: str, http: str, tokenizer: Tokenizer,
                 expected: list[list[int]]) -> None:
        self.router, self.http_address = router, http
        self.tokenizer, self.expected = tokenizer, expected
        self.counts: Counter[str] = Counter()
        self.tokens = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self._lock = threading.Lock()

    def run(self, index: int, deadline: float) -> None:
        rng = random.Random(index)
        session = requests.Session()
        with Client(self.router, timeout_s=120) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(["greedy", "sampled", "leave", "stalled", "http", "unary",
                                    "refused"], weights=[40, 15, 10, STALLED, 15, 12, 8])[0]
                self.once(kind, client, session, rng)

    def once(self, kind: str, client: Client | None, session: requests.Session | None,
             rng: random.Random) -> None:
        start = time.monotonic()
        try:
            tokens = getattr(self, kind)(client, session, rng)
        except Exception as exc:  # noqa: BLE001 - counted, reported at the end
            with self._lock:
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])
            return
        with self._lock:
            self.counts[kind] += 1
            self.tokens += tokens
            if kind != "refused":
                self.latencies.append(time.monotonic() - start)

    def _pick(self, rng: random.Random) -> tuple[int, int]:
        return rng.randrange(len(PROMPTS)), rng.randint(4, MAX_TOKENS)

    def greedy(self, client: Client, _, rng: random.Random) -> int:
        p, n = self._pick(rng)
        mode = rng.choice(["auto", "fixed", "off"])
        stream = client.stream(PROMPTS[p], max_tokens=n, temperature=0.0, ignore_eos=True,
                               speculation=mode, gamma_max=rng.randint(1, 5))
        tokens = [t for delta in stream for t in delta.token_ids]
        _check(tokens == self.expected[p][:n], f"greedy {mode} prompt {p}: wrong tokens")
        _check(stream.result().finish_reason == "length", "greedy: finish reason")
        return len(tokens)

    def sampled(self, client: Client, _, rng: random.Random) -> int:
        p, n = self._pick(rng)
        result = client.generate(PROMPTS[p], max_tokens=n, temperature=0.8, top_p=0.95,
                                 seed=rng.randrange(2**32), ignore_eos=True,
                                 speculation=rng.choice(["auto", "fixed"]))
        _check(len(result.token_ids) == n and result.finish_reason == "length", "sampled")
        return n

    def leave(self, client: Client, _, rng: random.Random) -> int:
        p, _ = self._pick(rng)
        with client.stream(PROMPTS[p], max_tokens=400, temperature=0.0) as stream:
            first = next(iter(stream))  # then the client goes away
        return len(first.token_ids)

    def stalled(self, _, __, rng: random.Random) -> int:
        """An HTTP stream whose client stops reading (a small receive window) for longer
        than the bound, then reads: the router must have cancelled it as unread (its
        stream ends with that error), not served it whole nor merely seen it leave."""
        p, _ = self._pick(rng)
        # ~330 KB of events (20 logprobs a token), where the buffers between the router
        # and the client hold ~55 KB: its writes wait for the client whatever the pace
        longest = CONTEXT - len(PROMPTS[p]) - 1  # (token ids)
        body = json.dumps({"model": "soak-target", "prompt": PROMPTS[p], "max_tokens": longest,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "logprobs": 20}).encode()
        host, port = self.http_address.rsplit(":", 1)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(60)
            sock.connect((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            _wait_unread(sock)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        last = received.rsplit(b"data: {", 1)[-1]
        _check(UNREAD.encode() in last, f"stalled: the stream ended {last[-200:]!r}")
        return 0

    def http(self, _, session: requests.Session, rng: random.Random) -> int:
        p, n = self._pick(rng)
        body = {"model": "soak-target", "prompt": PROMPTS[p], "max_tokens": n,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text, usage = "", None
        with self._post(session, body) as response:
            _check(response.status_code == 200, f"http status {response.status_code}")
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                _check("error" not in chunk, f"http stream error {chunk}")
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
        _check(text == self.tokenizer.decode(self.expected[p][:n]), "http: wrong text")
        _check(usage is not None and usage["completion_tokens"] == n, "http: usage")
        return n

    def _post(self, session: requests.Session, body: dict) -> requests.Response:
        """A completion request, sent again once if its kept-alive connection was reset
        before any answer, as the openai client does: the server may close an idle
        connection (uvicorn: after 5 s) just as a request goes out on it. Counted."""
        url = f"http://{self.http_address}/v1/completions"
        try:
            return session.post(url, json=body, stream=True, timeout=120)
        except requests.ConnectionError:
            with self._lock:
                self.counts["http_resent"] += 1
            return session.post(url, json=body, stream=True, timeout=120)

    def unary(self, client: Client, _, rng: random.Random) -> int:
        p, n = self._pick(rng)
        result = client.generate(PROMPTS[p], max_tokens=n, temperature=0.0, ignore_eos=True)
        _check(list(result.token_ids) == self.expected[p][:n], "unary: wrong tokens")
        return n

    def refused(self, client: Client, _, rng: random.Random) -> int:
        bad = rng.choice([dict(top_p=1.5), dict(max_tokens=10**6), dict(temperature=-1.0),
                          dict(stop_token_ids=[-1]), dict(tag="no spaces allowed")])
        try:
            client.generate(PROMPTS[0], **bad)
        except InvalidRequestError:
            return 0
        raise AssertionError(f"{bad} was not refused")


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def trend_mb_per_min(samples: list[tuple[float, dict[str, int]]], name: str) -> float:
    """How fast `name` kept climbing after the warm-up (MB a minute): the smaller of the
    rate between each sample from WARMUP_S and the first one TREND_LAG_S later, at its
    40th percentile, and the rate from the steady state's first TREND_LAG_S to its last."""
    steady = [(t, sample[name] / 1024) for t, sample in samples if t >= WARMUP_S]
    rates = []
    for i, (t0, mb0) in enumerate(steady):
        later = next(((t, mb) for t, mb in steady[i:] if t >= t0 + TREND_LAG_S), None)
        if later is None:
            break
        rates.append((later[1] - mb0) / (later[0] - t0) * 60)
    if len(rates) < 2:
        return max(rates, default=0.0)
    first = statistics.median(mb for t, mb in steady if t < WARMUP_S + TREND_LAG_S)
    last = statistics.median(mb for t, mb in steady if t >= SOAK_S - TREND_LAG_S)
    stayed = (last - first) / (SOAK_S - WARMUP_S - TREND_LAG_S) * 60
    return min(statistics.quantiles(rates, n=5, method="inclusive")[1], stayed)


def test_the_memory_trend_passes_a_step_and_fails_a_steady_climb():
    """The trend bound on CI's router: flat at 130 MB after the warm-up, then one step to
    137 MB, passes at whatever second the step comes, as does a rise of 7 MB over 40 s
    that falls back; a climb of 1 MB per 15 s fails."""
    def router(extra) -> list[tuple[float, dict[str, int]]]:  # 1 Hz, +-0.5 MB of jitter
        return [(float(t), {"router": round((130 + (t % 2 - 0.5) + extra(t)) * 1024)})
                for t in range(int(SOAK_S) + 1)]

    bound = MAX_TREND_MB_PER_MIN["router"]
    for step_at in range(int(WARMUP_S), int(SOAK_S) + 1):
        assert trend_mb_per_min(router(lambda t, at=step_at: 7 * (t >= at)), "router") < bound
    rise = WARMUP_S + (SOAK_S - WARMUP_S) / 6
    assert trend_mb_per_min(router(lambda t: 7 * min(1, max(0, (t - rise) / 40)) - 7 * (
        t >= SOAK_S - (SOAK_S - WARMUP_S) / 6)), "router") < bound
    assert trend_mb_per_min(router(lambda t: t / 15), "router") >= bound


@pytest.mark.timeout(SOAK_S + 240)  # a long soak outlives the suite's 300 s per test
def test_soak_many_streams_no_errors_no_growth_nothing_held(llama_dir, draft_dir, tmp_path):
    import shutil

    # the served model's id is its folder's name
    model = tmp_path / "soak-target"
    shutil.copytree(llama_dir, model)
    edit_config(model, max_position_embeddings=CONTEXT)
    expected = reference_greedy(model, PROMPTS, MAX_TOKENS)
    store = RedisServer(free_port(), tmp_path).start() if WITH_REDIS else None
    with contextlib.ExitStack() as cleanup, process_group(TOKEN) as start:
        if store is not None:
            cleanup.callback(store.kill)
        draft_proc, draft = start("draft-worker", "--model", str(draft_dir))
        target_proc, target = start("target-worker", "--model", str(model), "--draft-address",
                                    draft, "--max-num-seqs", "64")
        # a free port taken just before the router binds it: taken while the workers
        # started, another test's server was once given it first
        http_port = free_port()
        router_proc, router = start("router", "--model", str(model), "--target-address",
                                    target, "--port", "0", "--http-port", str(http_port),
                                    *(["--redis", store.url] if store else []))
        procs = {"router": router_proc, "target": target_proc, "draft": draft_proc}
        soak = Soak(router, f"127.0.0.1:{http_port}", Tokenizer(str(model)), expected)
        samples: list[tuple[float, dict[str, int]]] = []
        began = time.monotonic()
        deadline = began + SOAK_S
        threads = [threading.Thread(target=soak.run, args=(i, deadline), daemon=True)
                   for i in range(STREAMS)]
        threads += [threading.Thread(target=soak.once, daemon=True,
                                     args=("stalled", None, None, random.Random(STREAMS + i)))
                    for i in range(STALLED_CLIENTS)]
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - began,
                            {name: rss_kb(p.pid) for name, p in procs.items()}))
            time.sleep(1.0)
        for t in threads:
            t.join(timeout=180)
        stuck = sum(t.is_alive() for t in threads)  # a stream that never ended is an error
        workers = Workers(target, draft, TOKEN)
        idle_s = workers.wait_idle(timeout_s=20)
        alive = {name: p.poll() is None for name, p in procs.items()}
    warm = [s for t, s in samples if WARMUP_S - 3 <= t <= WARMUP_S]
    final = [s for t, s in samples if t >= SOAK_S - 4]
    growth = {name: statistics.median(s[name] for s in final) /
              statistics.median(s[name] for s in warm) - 1 for name in procs}
    trend = {name: trend_mb_per_min(samples, name) for name in procs}
    total_requests = sum(n for kind, n in soak.counts.items()
                         if kind != "http_resent")
    latencies = sorted(soak.latencies)
    record("soak", seconds=SOAK_S, streams=STREAMS, redis=WITH_REDIS, requests=total_requests,
           by_kind=dict(soak.counts), errors=len(soak.errors), tokens=soak.tokens,
           tokens_per_s=round(soak.tokens / SOAK_S, 1),
           request_p50_s=round(latencies[len(latencies) // 2], 3),
           request_p99_s=round(latencies[int(len(latencies) * 0.99)], 3),
           rss_mb_end={n: round(statistics.median(s[n] for s in final) / 1024, 1)
                       for n in procs},
           rss_growth_pct={n: round(100 * g, 2) for n, g in growth.items()},
           rss_trend_mb_per_min={n: round(r, 2) for n, r in trend.items()},
           rss_mb_every_15_s={n: [round(sample[n] / 1024) for _, sample in samples[::15]]
                              for n in procs},
           idle_after_s=round(idle_s, 2))
    assert soak.errors == [] and stuck == 0, (soak.errors, stuck)
    assert all(alive.values()), alive
    assert all(soak.counts[k] > 0 for k in ("greedy", "sampled", "leave", "http", "unary"))
    # backpressure ran: every stalled client was cancelled as unread (else an error above)
    assert soak.counts["stalled"] >= STALLED_CLIENTS, soak.counts
    assert all(trend[n] < MAX_TREND_MB_PER_MIN[n] for n in procs), (trend, growth)
    assert all(g < MAX_GROWTH for g in growth.values()), (growth, trend)
