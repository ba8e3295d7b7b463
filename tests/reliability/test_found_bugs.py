"""Product bugs the reliability work found (issue 11) that are still open. Every test
here FAILS on the code as it is and passes once the bug is fixed; its docstring names
the code at fault and the fix proposed (docs/RELIABILITY.md, "Findings"). The findings
already fixed have their regression tests in test_regressions.py and test_failures.py.

    .venv/bin/python -m pytest tests/reliability/test_found_bugs.py --runxfail

In `make test` they are expected failures (xfail, strict), so CI stays green while the
bugs are open and turns red when one is fixed without its marker removed.
"""

from __future__ import annotations

import time

import pytest

from outrider.client import Client
from outrider.engine.distributed import free_port
from outrider.launch import process_group
from tests.reliability._support import RedisServer

TOKEN = "reliability-found-bugs-token"
# reported as xfailed (never as passed) while the bug is open; strict: a fix that makes
# one pass turns it red until the marker goes
OPEN_BUG = pytest.mark.xfail(strict=True, reason="open finding, docs/RELIABILITY.md")


@pytest.mark.slow
@OPEN_BUG
def test_a_request_id_is_usable_again_after_its_router_crashed(llama_dir, tmp_path):
    """A router SIGKILLed mid-stream never closes its request's journal in Redis: the
    record stays "running" for the journal TTL (600 s), so the client that retries with
    the same request id (the idempotency key, as the README invites) gets ALREADY_EXISTS
    "still running" for ten minutes from every router, although nothing runs it.
    Where: router/service.py _open_journal and router/state.py RedisStore.journal_start
    (no owner or lease on an unfinished journal). Fix: give an unfinished journal a short
    lease that the owning router renews with each append (the full TTL once finished);
    a retry that finds an expired lease takes the request over, and can even resume it
    from the journaled tokens (resume_output_ids), as a replica failure does."""
    redis_server = RedisServer(free_port(), tmp_path).start()
    port = free_port()
    router_args = ("router", "--model", str(llama_dir), "--redis", redis_server.url,
                   "--port", str(port), "--no-http")
    options = dict(max_tokens=300, temperature=0.0, ignore_eos=True, request_id="crash-1")
    try:
        with process_group(TOKEN) as start:
            _, target = start("target-worker", "--model", str(llama_dir))
            router_proc, router = start(*router_args, "--target-address", target)
            with Client(router, timeout_s=60) as client:
                stream = client.stream([5, 6, 7], **options)
                next(iter(stream))
                router_proc.kill()  # SIGKILL: no goodbye
                router_proc.wait()
            _, router = start(*router_args, "--target-address", target)
            with Client(router, timeout_s=60) as client:
                time.sleep(5)  # longer than any heartbeat or lease would need
                again = client.generate([5, 6, 7], **options)  # ALREADY_EXISTS today
            assert again.usage.completion_tokens == 300
    finally:
        redis_server.kill()


@pytest.mark.slow
@OPEN_BUG
def test_a_router_full_of_streams_still_answers(llama_dir):
    """The router serves gRPC from one pool of 128 threads (router/main.py
    RouterConfig.max_workers) and every open stream holds one. With more streams open
    than that (140 here, a modest load for 32+ clients with several streams each), the
    router stops answering anything on its gRPC port: health checks, Status and new
    requests all wait in gRPC's queue until their deadlines (measured: health and Status
    DEADLINE_EXCEEDED after 3 s, a 2-token request after 20 s), although the target
    has room. A liveness probe then restarts the router and every stream on it is lost.
    The README promises RESOURCE_EXHAUSTED with a retry hint for overload. Fix: refuse
    streams beyond the pool at once (grpc.server(maximum_concurrent_rpcs=...) answers
    RESOURCE_EXHAUSTED), with health and Status kept answerable (their own small server
    or pool, or grpc.aio so streams do not hold threads)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from outrider.v1 import generate_pb2 as gp
    from outrider.v1 import generate_pb2_grpc

    request = gp.GenerateRequest(token_ids=gp.TokenIds(ids=[5, 6, 7]),
                                 sampling=gp.SamplingOptions(max_tokens=400, temperature=0.0,
                                                             ignore_eos=True))
    with process_group(TOKEN) as start:
        _, target = start("target-worker", "--model", str(llama_dir))
        _, router = start("router", "--model", str(llama_dir), "--target-address", target,
                          "--port", "0", "--no-http")
        with grpc.insecure_channel(router) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            streams = [stub.GenerateStream(request, timeout=120) for _ in range(140)]
            try:
                time.sleep(3)
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)  # DEADLINE_EXCEEDED today
                assert health.status in (health_pb2.HealthCheckResponse.SERVING,
                                         health_pb2.HealthCheckResponse.NOT_SERVING)
                try:
                    stub.Generate(gp.GenerateRequest(text="hi"), timeout=10)
                except grpc.RpcError as err:  # refused at once is fine; a hang is not
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.code()
            finally:
                for s in streams:
                    s.cancel()
