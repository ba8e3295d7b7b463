"""A stream outlives its router (docs/DESIGN.md §9.4): two routers share Redis in front of
one target; the router serving an SDK stream is SIGKILLed mid-stream, and the stream goes
on through the other, token for token what an uninterrupted run gives."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from outrider import paths
from outrider.client import Client, build_request
from outrider.launch import outrider_process, redis_server
from outrider.local_system import LocalSystemConfig, local_system
from outrider.v1 import generate_pb2_grpc
from tests.processes import listening_pid

pytestmark = pytest.mark.slow

TOKEN = "resume-test-token"
# seeded sampling under FIXED speculation gives the same tokens whatever breaks (§3.6)
REQUEST = dict(max_tokens=400, ignore_eos=True, temperature=0.8, seed=11,
               speculation="fixed", gamma_max=4)


@pytest.fixture(scope="module")
def two_routers(tmp_path_factory):
    target, draft = str(paths.demo_target_dir()), str(paths.demo_draft_dir())
    with redis_server(str(tmp_path_factory.mktemp("redis"))) as redis_url:
        cfg = LocalSystemConfig(target, draft, grpc_port=0, redis_url=redis_url)
        with local_system(cfg, TOKEN) as system, outrider_process(
                "router", "--model", target, "--target-address", system.target,
                "--redis", redis_url, "--port", "0", "--no-http", token=TOKEN) as (_, other):
            yield system.router, other


def test_an_sdk_stream_survives_its_router_being_killed(two_routers):
    first, second = two_routers
    with Client(second, timeout_s=120) as client:
        reference = client.generate("def parse(text):", **REQUEST)
    killed = False
    with Client(f"ipv4:{first},{second}", timeout_s=120) as client:  # tries `first` first
        stream = client.stream("def parse(text):", **REQUEST)
        opened, open_call = [], stream._open  # each request the stream sends after its first

        def recorded(request):
            opened.append(request.resume_from)
            return open_call(request)
        stream._open = recorded
        for n, _ in enumerate(stream):
            if n == 3:
                os.kill(listening_pid(int(first.rsplit(":", 1)[1])), signal.SIGKILL)
                killed = True
        resumed = stream.result()
    assert killed
    # it broke (so it was on the killed router) and went on from the tokens it had
    assert opened and all(3 < k < REQUEST["max_tokens"] for k in opened), opened
    assert resumed.token_ids == reference.token_ids
    assert resumed.text == reference.text
    assert resumed.usage.completion_tokens == REQUEST["max_tokens"]
    assert resumed.finish_reason == "length"


def test_resuming_an_unknown_request_is_refused(two_routers):


    request = build_request("x", max_tokens=4, request_id="never-ran")
    request.resume_from = 2
    with grpc.insecure_channel(two_routers[1]) as channel, \
            pytest.raises(grpc.RpcError) as failure:
        list(generate_pb2_grpc.GenerationStub(channel).GenerateStream(request))
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no journal to resume from" in failure.value.details()
