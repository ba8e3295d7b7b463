"""The Python SDK (outrider.client): typed results, the asyncio client, batches,
deadlines, retries through the gRPC service config, and riding out a router restart."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from contextlib import ExitStack

import grpc
import pytest

from outrider.client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidRequestError,
    Retry,
    UnavailableError,
)
from outrider.launch import free_port, outrider_process, process_group
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc
from tests.reliability._support import Workers
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

TOKEN = "sdk-test-token"
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(llama_dir, draft_dir):
    """The target replica's address, its /metrics address, and probes of both workers."""
    metrics = f"127.0.0.1:{free_port()}"
    with process_group(TOKEN) as start:
        _, draft = start("draft-worker", "--model", str(draft_dir))
        _, target = start("target-worker", "--model", str(llama_dir), "--draft-address", draft,
                          "--kv-cache-mb", "8", "--metrics-port", metrics.rsplit(":", 1)[1])
        probes = Workers(target, draft, TOKEN)
        yield target, metrics, probes
        probes.close()


@pytest.fixture(scope="module")
def workers(replica):
    return replica[0]


def generated_tokens(metrics: str) -> float:
    """Tokens the target replica has committed so far, over all requests."""
    return total(scrape(metrics), "vllm:generation_tokens_total")


def router(stack: ExitStack, llama_dir, target: str, port: int = 0) -> str:
    _, address = stack.enter_context(outrider_process(
        "router", "--model", str(llama_dir), "--target-address", target, "--port", str(port),
        "--no-http", token=TOKEN))
    return address


def test_typed_results_batches_and_the_async_client_agree(workers, llama_dir):
    prompts = [PROMPT, PROMPT[:5], "hello"]
    with ExitStack() as stack:
        address = router(stack, llama_dir, workers)
        with Client(address, timeout_s=120) as client:
            one_by_one = [client.generate(p, max_tokens=12, **GREEDY) for p in prompts]
            batch = client.generate_batch(prompts, max_concurrency=3, max_tokens=12, **GREEDY)

        async def with_asyncio():
            async with AsyncClient(address, timeout_s=120) as client:
                deltas = [d async for d in client.stream(PROMPT, max_tokens=12, **GREEDY)]
                batch = await client.generate_batch(prompts, max_tokens=12, **GREEDY)
                return deltas, batch
        deltas, async_batch = asyncio.run(with_asyncio())
    for results in (batch, async_batch):
        assert [r.token_ids for r in results] == [r.token_ids for r in one_by_one]
    assert tuple(t for d in deltas for t in d.token_ids) == one_by_one[0].token_ids
    first = one_by_one[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 12
    assert first.usage.total_tokens == len(PROMPT) + 12
    assert first.speculation.rounds >= 1 and first.replica == workers
    assert 0 < first.timings.ttft_s <= first.timings.total_s and first.timings.tokens_per_s > 0
    assert first.to_dict()["usage"]["total_tokens"] == first.usage.total_tokens


def test_deadlines_are_honoured_and_free_the_replica(replica, llama_dir):
    target, metrics, probes = replica
    with ExitStack() as stack:
        address = router(stack, llama_dir, target)
        with Client(address, timeout_s=120) as client:
            client.generate(PROMPT, max_tokens=1, **GREEDY)  # the router knows the replica
            probes.wait_idle()
            before = generated_tokens(metrics)
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError):  # 500 tokens take seconds at γ = 4
                client.generate(PROMPT, max_tokens=500, timeout_s=0.5, speculation="fixed",
                                gamma_max=4, **GREEDY)
            assert time.monotonic() - start < 5
            with pytest.raises(InvalidRequestError) as err:
                client.generate(PROMPT, top_p=1.5)
            assert "top_p" in err.value.message and err.value.code.name == "INVALID_ARGUMENT"
            # freed: no sequence, every KV block free, the draft's sequence gone ...
            probes.wait_idle(timeout_s=20)
            # ... because the replica stopped it at the deadline: it had started, and it
            # did not run on to its length for nobody
            assert 0 < generated_tokens(metrics) - before < 500
            deadline = time.monotonic() + 20
            while client.status().replicas[0].num_running and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.status().replicas[0].num_running == 0


def test_a_session_survives_a_router_restart(workers, llama_dir):
    port = free_port()
    with ExitStack() as first:
        address = router(first, llama_dir, workers, port)
        client = Client(address, timeout_s=90)
        before = client.generate(PROMPT, max_tokens=10, **GREEDY)
    # the router is gone; a new one comes up on the same port while a call is waiting
    with ExitStack() as second:
        restarted = threading.Timer(1.0, router, (second, llama_dir, workers, port))
        restarted.start()
        after = client.generate(PROMPT, max_tokens=10, **GREEDY)
        restarted.join()
        client.close()
    assert after.token_ids == before.token_ids


class FlakyGeneration(generate_pb2_grpc.GenerationServicer):
    """Answers UNAVAILABLE `failures` times, then a one-token generation."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def GenerateStream(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        yield gp.GenerateResponse(request_id="r", text="x", token_ids=[1], finish_reason="stop")


@pytest.mark.parametrize("retry,failures,succeeds", [
    (Retry(initial_backoff_s=0.05, max_backoff_s=0.1), 3, True),
    (Retry(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.1), 3, False),
    (None, 1, False)], ids=["retried", "too-few-attempts", "no-retries"])
def test_unavailable_is_retried_by_the_service_config(retry, failures, succeeds):
    servicer = FlakyGeneration(failures)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", retry=retry, timeout_s=30) as client:
            if succeeds:
                assert client.generate("hi").text == "x"
            else:
                with pytest.raises(UnavailableError) as err:
                    client.generate("hi")
                assert err.value.message == "warming up"
    finally:
        server.stop(0)
    attempts = retry.max_attempts if retry else 1
    assert servicer.calls == (failures + 1 if succeeds else attempts)
