"""docs/DESIGN.md §6 failures, injected into live processes on loopback:

- a draft replica SIGKILLed mid-generation: its sequences (`proposer: model`) go on
  with γ = 0, and the same requests speculate again once a draft is restarted on the
  same port;
- a target replica SIGKILLed under seeded sampling with a fixed γ: the request resumes
  on the other replica and reproduces the uninterrupted run token for token;
- the shared Redis killed and restarted empty, or frozen, under load: every request
  finishes, routers serve from their snapshot, and registry, journal and statistics
  work again once it is back.

Each test records the recovery time (kill -> next token) and the tokens lost (always 0:
the outputs equal an uninterrupted run); docs/RELIABILITY.md lists the figures."""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
import redis

from outrider.client import Client
from outrider.launch import free_port, outrider_process, process_group
from tests.processes import two_targets_behind_a_router
from tests.reliability._support import (
    RedisServer,
    Workers,
    record,
    reference_greedy,
    wait_until,
)

pytestmark = pytest.mark.slow
TOKEN = "reliability-failures-token"


@dataclass
class StreamLog:
    """What one client stream saw: tokens, and each message's arrival time and rounds."""

    tokens: list[int] = field(default_factory=list)
    # (arrival time, number of token ids, the rounds' γ, the replica generating)
    events: list[tuple[float, int, tuple[int, ...], str]] = field(default_factory=list)
    finish_reason: str = ""
    replicas: set[str] = field(default_factory=set)
    error: BaseException | None = None

    def first_token_after(self, t: float) -> float | None:
        return next((at - t for at, n, _, _ in self.events if at > t and n), None)

    def first_token_from_another_replica(self, t: float, replica: str) -> float | None:
        return next((at - t for at, n, _, r in self.events if at > t and n and r != replica),
                    None)

    def gammas_between(self, start: float, end: float) -> list[int]:
        return [g for at, _, gammas, _ in self.events if start < at < end for g in gammas]


def read_stream(client: Client, prompt, log: StreamLog, stop: threading.Event | None = None,
                **options) -> None:
    """Consume one stream into `log` (in a thread); `stop` set: cancel it."""
    try:
        with client.stream(prompt, **options) as stream:
            for delta in stream:
                log.tokens.extend(delta.token_ids)
                log.replicas.add(delta.replica)
                log.events.append((time.monotonic(), len(delta.token_ids),
                                   tuple(r.gamma for r in delta.rounds), delta.replica))
                if stop is not None and stop.is_set():
                    log.finish_reason = "cancelled-by-test"
                    return
            log.finish_reason = stream.result().finish_reason
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        log.error = exc


# -- draft replica SIGKILL ----------------------------------------------------------------------
DRAFT_PROMPTS = [[11, 23, 5, 87, 140, 9], [5, 6, 7], [100, 200, 31, 4]]
FINISHING_TOKENS = 700    # these requests run to the end
LONG_TOKENS = 4000        # this one outlives the draft's restart, then is cancelled
LONG_PROMPT = [42, 17, 250, 3]
LONG_CHECKED = 1500       # its tokens checked against the reference (a prefix)
# the draft model alone: `auto` would go on looking up while no draft answers, and a
# suffix match from the earlier streams would stand in for the restarted draft
FIXED = dict(temperature=0.0, ignore_eos=True, speculation="fixed", gamma_max=4,
             include_rounds=True, proposer="model")


def test_draft_killed_mid_generation_then_restarted_on_its_port(long_target_dir, long_draft_dir):
    """γ = 0 while no draft answers, speculation again in the same requests once a
    draft is back on the same port; outputs identical to an uninterrupted greedy run,
    no request fails (running ones, or new ones sent during the outage)."""
    expected = reference_greedy(long_target_dir, DRAFT_PROMPTS, FINISHING_TOKENS)
    expected_long = reference_greedy(long_target_dir, [LONG_PROMPT], LONG_CHECKED)[0]
    port = free_port()
    draft_args = ("draft-worker", "--model", str(long_draft_dir), "--port", str(port))
    with process_group(TOKEN) as start:
        draft_proc, draft = start(*draft_args)
        _, target = start("target-worker", "--model", str(long_target_dir),
                          "--draft-address", draft)
        _, router = start("router", "--model", str(long_target_dir), "--target-address",
                          target, "--port", "0", "--no-http")
        workers = Workers(target, draft, TOKEN)
        logs = [StreamLog() for _ in range(len(DRAFT_PROMPTS) + 1)]
        cancel_long = threading.Event()
        with Client(router, timeout_s=300) as client:
            threads = [threading.Thread(target=read_stream, args=(client, p, log),
                                        kwargs=dict(max_tokens=FINISHING_TOKENS, **FIXED))
                       for p, log in zip(DRAFT_PROMPTS, logs)]
            threads.append(threading.Thread(target=read_stream,
                                            args=(client, LONG_PROMPT, logs[-1], cancel_long),
                                            kwargs=dict(max_tokens=LONG_TOKENS, **FIXED)))
            for t in threads:
                t.start()
            # every stream speculating: then the crash (no goodbye)
            wait_until(lambda: all(any(g for e in log.events for g in e[2]) and
                                   len(log.tokens) >= 20 for log in logs), 60, 0.01)
            killed_at = time.monotonic()
            draft_proc.kill()
            draft_proc.wait()
            time.sleep(0.3)
            during = client.generate(LONG_PROMPT, max_tokens=40, **FIXED)  # a new request
            respawned_at = time.monotonic()  # no draft can answer before this
            with outrider_process(*draft_args, token=TOKEN):
                restarted_at = time.monotonic()  # listening again on the same port
                long = logs[-1]
                wait_until(lambda: any(long.gammas_between(restarted_at, math.inf))
                           or long.error or long.finish_reason, 60, 0.01)
                resumed_at = next((at for at, _, gammas, _ in long.events
                                   if at > restarted_at and any(gammas)), math.nan)
                n_long = len(long.tokens)
                wait_until(lambda: len(long.tokens) >= n_long + 20 or long.error
                           or long.finish_reason, 60, 0.01)
                cancel_long.set()
                for t in threads:
                    t.join(timeout=300)
                after = client.generate(LONG_PROMPT, max_tokens=40, **FIXED)
                idle_s = workers.wait_idle()
    assert [log.error for log in logs] == [None] * len(logs)
    for log, want in zip(logs, expected):
        assert log.tokens == want and log.finish_reason == "length"
    assert long.finish_reason == "cancelled-by-test"
    checked = min(len(long.tokens), LONG_CHECKED)
    assert long.tokens[:checked] == expected_long[:checked] and checked > 100
    # no draft: γ = 0 (rounds settled 0.3 s after the kill, until a new draft started)
    outage = long.gammas_between(killed_at + 0.3, respawned_at)
    assert outage and set(outage) == {0}
    assert {r.gamma for r in during.rounds} == {0}
    assert list(during.token_ids) == expected_long[:40]
    # the same request speculates again, and so do new ones
    assert any(long.gammas_between(restarted_at, math.inf))
    assert any(r.gamma for r in after.rounds) and list(after.token_ids) == expected_long[:40]
    recovery = max(log.first_token_after(killed_at) for log in logs
                   if log.first_token_after(killed_at) is not None)
    record("draft_sigkill", recovery_s=round(recovery, 3),
           outage_s=round(restarted_at - killed_at, 2),
           speculation_resumed_s=round(resumed_at - restarted_at, 3), tokens_lost=0,
           failed_requests=0, idle_after_s=round(idle_s, 2))
    assert recovery < 5.0


# -- target replica SIGKILL under seeded sampling --------------------------------------------
SEEDED = dict(max_tokens=240, temperature=0.8, top_p=0.95, ignore_eos=True,
              speculation="fixed", gamma_max=3)
SEEDED_PROMPTS = [[11, 23, 5, 87, 140, 9], [7, 8, 9, 10], [30, 12, 77]]
KILL_AT = 40  # tokens each stream has at least when the kill comes


def test_seeded_sampling_resumed_after_target_kill_reproduces_the_run(llama_dir, draft_dir):
    """Two targets behind one router, temperature 0.8 + top-p + seed, fixed γ, three
    streams at once: after a SIGKILL of the replica serving them, they resume on the
    other one and every token equals the uninterrupted run's (randomness is keyed by
    seed and absolute position, so the new replica's round boundaries do not matter,
    and sampled sequences never draft ahead, so neither does the load: the three streams
    must equal their solo runs)."""
    with process_group(TOKEN) as start:
        targets, router = two_targets_behind_a_router(start, llama_dir, draft_dir)
        with Client(router, timeout_s=300) as client:
            wait_until(lambda: len(client.status().replicas) == 2, 30)
            seeds = [1000 + i for i in range(len(SEEDED_PROMPTS))]
            reference = [client.generate(p, seed=s, **SEEDED)
                         for p, s in zip(SEEDED_PROMPTS, seeds)]
            logs = [StreamLog() for _ in SEEDED_PROMPTS]
            threads = [threading.Thread(target=read_stream, args=(client, p, log),
                                        kwargs=dict(seed=s, **SEEDED))
                       for p, s, log in zip(SEEDED_PROMPTS, seeds, logs)]
            for t in threads:
                t.start()
            wait_until(lambda: all(len(log.tokens) >= KILL_AT for log in logs), 60, 0.005)
            victim = logs[0].events[-1][3]  # the replica serving the first stream
            victims = [i for i, log in enumerate(logs) if log.events[-1][3] == victim]
            before = [len(logs[i].tokens) for i in victims]
            killed_at = time.monotonic()
            targets[victim].kill()  # SIGKILL: no goodbye
            for t in threads:
                t.join(timeout=300)
    assert [log.error for log in logs] == [None] * len(logs)
    for log, ref in zip(logs, reference):
        assert log.tokens == list(ref.token_ids)          # nothing lost, repeated or changed
        assert log.finish_reason == "length" and len(log.tokens) == SEEDED["max_tokens"]
    recovery = [logs[i].first_token_from_another_replica(killed_at, victim) for i in victims]
    assert None not in recovery  # each really moved
    record("target_sigkill_seeded_sampling", recovery_s=round(max(recovery), 3),
           migrated_streams=len(victims), tokens_before_kill=before, tokens_lost=0,
           tokens_changed=0)
    assert max(recovery) < 5.0


# -- Redis killed, restarted empty, frozen ---------------------------------------------------
REDIS_PROMPTS = [[5, 17, 42, 99], [11, 12, 13], [200, 2, 9], [31, 41, 59, 26]]
REDIS_TOKENS = 300
FROZEN_TOKENS = 450


@dataclass
class SharedRedisSystem:
    redis: RedisServer
    router_a: str      # told of the target
    router_b: str      # finds it through the shared registry only
    target: str
    workers: Workers


@pytest.fixture(scope="module")
def redis_system(llama_dir, draft_dir, tmp_path_factory):
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis")).start()
    try:
        with process_group(TOKEN) as start:
            _, draft = start("draft-worker", "--model", str(draft_dir))
            _, target = start("target-worker", "--model", str(llama_dir), "--draft-address",
                              draft)
            _, router_a = start("router", "--model", str(llama_dir), "--target-address",
                                target, "--redis", server.url, "--port", "0", "--no-http")
            _, router_b = start("router", "--model", str(llama_dir), "--redis", server.url,
                                "--port", "0", "--no-http")
            yield SharedRedisSystem(server, router_a, router_b, target,
                                    Workers(target, draft, TOKEN))
    finally:
        if server.proc is not None:
            server.signal(signal.SIGCONT)
        server.kill()


def test_redis_killed_and_restarted_empty_while_routers_serve(llama_dir, redis_system):
    """Two routers sharing a Redis (B knows the target only through the registry).
    Redis is SIGKILLed under streams and restarted empty on its port: running and new
    requests all finish with the right tokens, both routers keep their replica
    snapshot, Status says the store is unreachable, then reachable again; the registry,
    the shared journal (idempotent replay from the other router) and the acceptance
    statistics work again."""
    expected = reference_greedy(llama_dir, REDIS_PROMPTS, REDIS_TOKENS)
    # the draft model drafts: the shared acceptance statistics are its own (DESIGN §2.8)
    greedy = dict(temperature=0.0, ignore_eos=True, speculation="fixed", gamma_max=2,
                  proposer="model")
    sys_ = redis_system
    redis_server, target, workers = sys_.redis, sys_.target, sys_.workers
    with Client(sys_.router_a, timeout_s=120) as a, Client(sys_.router_b, timeout_s=120) as b:
        wait_until(lambda: [r.address for r in b.status().replicas] == [target], 30)
        assert a.status().is_store_reachable and b.status().is_store_reachable
        logs = [StreamLog() for _ in REDIS_PROMPTS]
        threads = [threading.Thread(target=read_stream, args=(c, p, log),
                                    kwargs=dict(max_tokens=REDIS_TOKENS, **greedy))
                   for c, p, log in zip((a, b, a, b), REDIS_PROMPTS, logs)]
        for t in threads:
            t.start()
        wait_until(lambda: all(len(log.tokens) >= 5 for log in logs), 60, 0.01)
        killed_at = time.monotonic()
        redis_server.kill()
        # new requests while the store is away, on both routers, one with a request id
        down = [c.generate(REDIS_PROMPTS[0], max_tokens=24, request_id=f"down-{i}", **greedy)
                for i, c in enumerate((a, b))]
        detect_s = wait_until(lambda: not a.status().is_store_reachable
                              and not b.status().is_store_reachable, 10)
        snapshot = [[r.address for r in c.status().replicas] for c in (a, b)]
        time.sleep(max(0.0, 1.5 - (time.monotonic() - killed_at)))
        restarted_at = time.monotonic()
        redis_server.start()  # the same port, no data
        reachable_s = wait_until(lambda: a.status().is_store_reachable
                                 and b.status().is_store_reachable, 15)
        store = redis.Redis.from_url(redis_server.url)
        registry_s = wait_until(lambda: store.exists(f"outrider:replica:{target}") == 1, 15)
        for t in threads:
            t.join(timeout=120)
        # the shared journal again: B replays what A finished under the same id
        first = a.generate(REDIS_PROMPTS[1], max_tokens=12, temperature=1.0,
                           request_id="after-restart")
        again = b.generate(REDIS_PROMPTS[1], max_tokens=12, temperature=1.0,
                           request_id="after-restart")
        stats = a.generate(REDIS_PROMPTS[2], max_tokens=16, tag="after-restart", **greedy)
        acceptance = b.status(tag="after-restart").acceptance
    idle_s = workers.wait_idle()
    assert [log.error for log in logs] == [None] * len(logs)
    assert [log.tokens for log in logs] == expected
    assert [list(g.token_ids) for g in down] == [expected[0][:24]] * 2
    assert snapshot == [[target], [target]]  # served from the snapshot while it was away
    assert (again.token_ids, again.request_id) == (first.token_ids, first.request_id)
    assert stats.speculation.rounds and len(acceptance) == 1
    assert sum(acceptance[0].tested_per_position) >= stats.speculation.rounds - 1
    gaps = [b_at - a_at for log in logs for (a_at, *_), (b_at, *_)
            in zip(log.events, log.events[1:]) if a_at >= killed_at]
    record("redis_sigkill_restart_empty", detect_unreachable_s=round(detect_s, 2),
           reachable_again_after_restart_s=round(reachable_s, 2),
           registry_repopulated_s=round(registry_s, 2),
           max_stream_gap_while_down_s=round(max(gaps, default=0.0), 3),
           outage_s=round(restarted_at - killed_at, 2), failed_requests=0, tokens_lost=0,
           idle_after_s=round(idle_s, 2))


def test_redis_frozen_neither_fails_nor_stalls_requests(llama_dir, redis_system):
    """Redis stops answering (SIGSTOP: connections hang rather than fail) for 4 s under a
    stream and a new request: the store's circuit breaker fails calls at once after the
    first timeout, so the stream keeps flowing (no gap over 2.5 s, 100+ tokens while
    frozen), the new request finishes in under 3 s, and both have the right tokens."""
    expected = reference_greedy(llama_dir, [REDIS_PROMPTS[0]], FROZEN_TOKENS)[0]
    redis_server = redis_system.redis
    with Client(redis_system.router_a, timeout_s=120) as client:
        log = StreamLog()
        thread = threading.Thread(target=read_stream, args=(client, REDIS_PROMPTS[0], log),
                                  kwargs=dict(max_tokens=FROZEN_TOKENS, temperature=0.0,
                                              ignore_eos=True))
        thread.start()
        wait_until(lambda: len(log.tokens) >= 5, 60, 0.01)
        redis_server.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        newcomer: list = []

        def new_request() -> None:
            start = time.monotonic()
            done = client.generate(REDIS_PROMPTS[0], max_tokens=8, temperature=0.0,
                                   ignore_eos=True)
            newcomer.append((done, time.monotonic() - start))
        starter = threading.Thread(target=new_request)
        starter.start()
        time.sleep(4.0)
        redis_server.signal(signal.SIGCONT)
        thawed_at = time.monotonic()
        thread.join(timeout=120)
        starter.join(timeout=120)
        reachable_s = wait_until(lambda: client.status().is_store_reachable, 15)
    assert log.error is None and log.tokens == expected
    assert [list(done.token_ids) for done, _ in newcomer] == [expected[:8]]
    frozen = [(at, n) for at, n, *_ in log.events if frozen_at < at < thawed_at]
    tokens_frozen = sum(n for _, n in frozen)
    times = [frozen_at] + [at for at, _ in frozen]
    gap = max(b - a for a, b in zip(times, times[1:] + [min(thawed_at, times[-1])]))
    record("redis_sigstop_4s", tokens_streamed_while_frozen=tokens_frozen,
           max_stream_gap_while_frozen_s=round(gap, 3),
           new_request_s=round(newcomer[0][1], 3), reachable_again_s=round(reachable_s, 2),
           failed_requests=0, tokens_lost=0)
    assert tokens_frozen >= 100 and gap < 2.5 and newcomer[0][1] < 3.0
    redis_system.workers.wait_idle()
