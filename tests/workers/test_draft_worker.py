"""The draft replica over real gRPC on loopback: same drafts as in-process, every q
format decodes to what the draft sampled from, MISS, release, auth, validation."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import torch

from outrider.core.sampling import SamplingParams, sampling_to_proto
from outrider.engine.drafter import Drafter
from outrider.engine.proposer import DraftItem
from outrider.engine.rejection import dense_draft_probs
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.grpc_server import token_metadata
from outrider.launch import free_port, outrider_process
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import Q_FORMAT_CODES, decode_q

TOKEN = "s3cret-test-token"
CONTEXT = [5, 17, 33, 2, 41, 99, 150, 7]
SAMPLINGS = {"ids": SamplingParams(),
             "point_mass": SamplingParams(temperature=0.8),
             "sparse": SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
             "dense_fp16": SamplingParams(temperature=1.0)}


@pytest.fixture(scope="module")
def channel(draft_dir):
    with outrider_process("draft-worker", "--model", str(draft_dir), "--kv-cache-mb", "1",
                          token=TOKEN) as (_, address), grpc.insecure_channel(address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return worker_pb2_grpc.DraftStub(channel)


def propose(stub, *seqs, token=TOKEN) -> pb.ProposeResponse:
    return stub.Propose(pb.ProposeRequest(sequences=list(seqs)), metadata=token_metadata(token),
                        timeout=30)


def seq(seq_id, committed_len, new, gamma, fmt, params=SAMPLINGS["ids"], seed=3):
    return pb.ProposeSequence(seq_id=seq_id, committed_len=committed_len, new_token_ids=new,
                              gamma=gamma, sampling=sampling_to_proto(params, seed),
                              q_format=Q_FORMAT_CODES[fmt])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(SAMPLINGS))
def test_remote_drafts_equal_in_process_drafts(stub, draft_dir, fmt):
    params = SAMPLINGS[fmt]
    local = Drafter(ModelRunner(RunnerConfig(str(draft_dir))))
    expected = local.draft([DraftItem("x", 0, CONTEXT, 4, params, 3, fmt)])
    reply = propose(stub, seq(f"x-{fmt}", 0, CONTEXT, 4, fmt, params)).proposals[0]
    assert not reply.miss
    assert list(reply.token_ids) == expected.token_ids[0].tolist()
    q = decode_q(reply, fmt, local.vocab_size)  # [gamma, vocab]
    if expected.probs is None:  # greedy drafts are point masses: nothing dense was built
        want = dense_draft_probs(expected.token_ids, local.vocab_size)[0]
    else:
        want = expected.probs[0] / expected.probs[0].sum(-1, keepdim=True)
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sync_miss_and_release(stub):
    first = propose(stub, seq("s", 0, CONTEXT[:5], 3, "ids")).proposals[0]
    assert len(first.token_ids) == 3
    fresh = propose(stub, seq("t", 0, CONTEXT, 3, "ids")).proposals[0]
    synced = propose(stub, seq("s", 5, CONTEXT[5:], 3, "ids")).proposals[0]
    assert list(synced.token_ids) == list(fresh.token_ids)
    assert propose(stub, seq("unknown", 4, [1], 3, "ids")).proposals[0].miss
    stats = stub.Stats(pb.DraftStatsRequest(), metadata=token_metadata(TOKEN))
    assert stats.num_sequences >= 2 and stats.num_misses >= 1
    released = stub.Release(pb.ReleaseRequest(seq_ids=["s", "t", "gone"]),
                            metadata=token_metadata(TOKEN))
    assert released.num_released == 2


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, "wrong"])
def test_callers_without_the_cluster_token_are_refused(stub, token):
    with pytest.raises(grpc.RpcError) as err:
        propose(stub, seq("a", 0, CONTEXT, 2, "ids"), token=token)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
@pytest.mark.parametrize("bad,field", [
    (seq("", 0, CONTEXT, 2, "ids"), "seq_id"),
    (seq("a", 0, CONTEXT, 99, "ids"), "gamma"),
    (seq("a", 0, [1, 10**6], 2, "ids"), "new_token_ids"),
    (seq("a", 0, CONTEXT, 2, "ids", SamplingParams(top_p=0.5)), None),
    (pb.ProposeSequence(seq_id="a", new_token_ids=CONTEXT, gamma=2), "q_format"),
])
def test_bad_sequences_are_invalid_argument(stub, bad, field):
    if field is None:  # a valid control case
        assert not propose(stub, bad).proposals[0].miss
        return
    with pytest.raises(grpc.RpcError) as err:
        propose(stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


@pytest.mark.slow
def test_bad_sampling_names_the_field(stub):
    bad = seq("a", 0, CONTEXT, 2, "ids")
    bad.sampling.temperature = float("nan")
    with pytest.raises(grpc.RpcError) as err:
        propose(stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in err.value.details()


@pytest.mark.slow
def test_health_is_open_without_the_token(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="outrider.v1.Draft"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_adapt_trains_in_the_background_and_reports_its_rounds(draft_dir):
    """`draft-worker --adapt`: released sequences feed the trainer; rounds show in the
    metrics; Propose keeps answering meanwhile."""
    port = free_port()
    with outrider_process("draft-worker", "--model", str(draft_dir), "--adapt",
                          "--adapt-round-tokens", "40", "--metrics-port", str(port),
                          token=TOKEN) as (_, address), grpc.insecure_channel(address) as chan:
        stub = worker_pb2_grpc.DraftStub(chan)
        for i in range(10):  # ten sequences: an 8-token prompt, then 3 rounds of 4 tokens
            prompt = [(i * 31 + j) % 200 + 1 for j in range(8)]
            sid = f"adapt-{i}"
            first = seq(sid, 0, prompt, 3, "ids")
            first.prompt_len = 8
            propose(stub, first)
            done = prompt
            for _ in range(3):
                new = [(t * 7 + 3) % 200 for t in done[-4:]]
                item = seq(sid, len(done), new, 3, "ids")
                item.prompt_len = 8
                assert not propose(stub, item).proposals[0].miss
                done = done + new
            stub.Release(pb.ReleaseRequest(seq_ids=[sid]), metadata=token_metadata(TOKEN),
                         timeout=30)
        deadline = time.monotonic() + 90
        rounds = 0.0
        while time.monotonic() < deadline and not rounds:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=5).read().decode()
            rounds = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("outrider_draft_adapt_rounds_total{"))
            time.sleep(0.5)
        assert rounds >= 1
        assert "outrider:draft_version{" in text
        assert not propose(stub, seq("after", 0, CONTEXT, 2, "ids")).proposals[0].miss


def stand_ins_beyond(metrics: str, count: float, deadline: float) -> float:
    """The replica's count of stand-ins drafted, once it passes `count` (the next fill
    done: a Propose that comes before it ends finds that fill's stand-ins, not its own)."""
    from tests.scraping import scrape, total

    while (now := total(scrape(metrics), "outrider_draft_speculation_cache_stand_ins_total")) \
            <= count:
        assert time.monotonic() < deadline, "no stand-ins drafted"
        time.sleep(0.05)
    return now


@pytest.mark.slow
def test_the_speculation_cache_answers_an_outcome_it_drafted_for(draft_dir):
    """With --speculation-cache, the replica drafts the likely outcomes of a round after
    answering it; the next Propose that brings one (here: every draft kept, then the
    draft's own next token) is answered from there, as drafting that context would. One
    that asks for ready drafts only and misses is answered with none; the round after,
    the target's token being the draft's guess, is answered from the cache."""
    from tests.scraping import scrape, total

    metrics = f"127.0.0.1:{free_port()}"
    local = Drafter(ModelRunner(RunnerConfig(str(draft_dir))))
    with outrider_process("draft-worker", "--model", str(draft_dir), "--kv-cache-mb", "4",
                          "--speculation-cache", "--metrics-port", metrics.rsplit(":", 1)[1],
                          token=TOKEN) as (_, address), grpc.insecure_channel(address) as chan:
        stub = worker_pb2_grpc.DraftStub(chan)
        drafts = list(propose(stub, seq("c", 0, CONTEXT, 4, "ids")).proposals[0].token_ids)
        deadline = time.monotonic() + 30
        prepared = stand_ins_beyond(metrics, 0, deadline)
        bonus = local.draft([DraftItem("b", 0, CONTEXT + drafts, 1, SAMPLINGS["ids"], 3,
                                       "ids")]).token_ids[0, 0].item()
        reply = propose(stub, seq("c", len(CONTEXT) + 3, [drafts[3], bonus], 4, "ids"))
        want = local.draft([DraftItem("x", 0, CONTEXT + drafts + [bonus], 4,
                                      SAMPLINGS["ids"], 3, "ids")])
        assert list(reply.proposals[0].token_ids) == want.token_ids[0].tolist()
        assert reply.proposals[0].cache_rank >= 1
        samples = scrape(metrics)
        assert total(samples, "outrider_draft_speculation_cache_lookups_total",
                     result="hit") == 1
        assert stub.Stats(pb.DraftStatsRequest(), metadata=token_metadata(TOKEN)).\
            speculation_cache

        context = CONTEXT + drafts + [bonus]
        prepared = stand_ins_beyond(metrics, prepared, deadline)  # this round's outcomes'
        unguessed = next(t for t in range(100, 200) if t != want.token_ids[0, 0].item())
        ready = seq("c", len(context), [unguessed], 4, "ids")
        ready.ready_only = True
        reply = propose(stub, ready).proposals[0]
        assert not reply.token_ids and not reply.miss and not reply.cache_rank
        stand_ins_beyond(metrics, prepared, deadline)  # the miss's
        context.append(unguessed)
        guess = local.draft([DraftItem("g", 0, context, 1, SAMPLINGS["ids"], 3, "ids")])
        ready.new_token_ids.append(guess.token_ids[0, 0].item())
        reply = propose(stub, ready).proposals[0]
        want = local.draft([DraftItem("y", 0, context + [guess.token_ids[0, 0].item()], 4,
                                      SAMPLINGS["ids"], 3, "ids")])
        assert list(reply.token_ids) == want.token_ids[0].tolist() and reply.cache_rank == 1
