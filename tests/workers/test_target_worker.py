"""Target + draft replicas as separate processes on loopback."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from outrider.core.sampling import SamplingParams, sampling_to_proto
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.grpc_server import token_metadata
from outrider.launch import free_port, outrider_process
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from tests.checkpoints import VOCAB
from tests.scraping import scrape, total

TOKEN = "cluster-token-for-tests"
pytestmark = pytest.mark.slow


def prompts(n: int, seed: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (2 + (5 * i) % 37,), generator=g).tolist() for i in range(n)]


def request_for(i: int, prompt: list[int], gamma: int, max_tokens: int,
                sampled: bool) -> pb.TargetRequest:
    params = (SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i) if sampled
              else SamplingParams())
    return pb.TargetRequest(request_id=f"r{i}-{time.monotonic_ns()}", prompt_ids=prompt,
                            sampling=sampling_to_proto(params, params.seed),
                            max_tokens=max_tokens, ignore_eos=True,
                            spec_mode=pb.SPEC_MODE_FIXED if gamma else pb.SPEC_MODE_OFF,
                            gamma=gamma)


def run_remote(stub, req: pb.TargetRequest) -> list[int]:
    tokens = []
    for chunk in stub.Generate(req, metadata=token_metadata(TOKEN), timeout=120):
        tokens.extend(chunk.token_ids)
    return tokens


def run_local(llama_dir, draft_dir, req: pb.TargetRequest, overlap: bool = False) -> list[int]:
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                                 Drafter(ModelRunner(RunnerConfig(str(draft_dir)))),
                                 overlap_max_seqs=1 << 30 if overlap else 0)
    s = req.sampling
    params = SamplingParams(max_tokens=req.max_tokens, temperature=s.temperature,
                            top_p=s.top_p or 1.0, seed=s.seed, ignore_eos=True)
    return decoder.generate([list(req.prompt_ids)], params, req.gamma)[0].output_ids


@pytest.fixture(scope="module")
def cluster_and_metrics(llama_dir, draft_dir):
    """(target stub, draft stub), and the target's /metrics address."""
    metrics = f"127.0.0.1:{free_port()}"
    with outrider_process("draft-worker", "--model", str(draft_dir), token=TOKEN) as (_, d_addr), \
         outrider_process("target-worker", "--model", str(llama_dir), "--draft-address", d_addr,
                          "--kv-cache-mb", "2", "--max-batch-tokens", "96",
                          "--metrics-port", metrics.rsplit(":", 1)[1],
                          token=TOKEN) as (_, t_addr), \
         grpc.insecure_channel(t_addr) as t_chan, grpc.insecure_channel(d_addr) as d_chan:
        yield (worker_pb2_grpc.TargetStub(t_chan), worker_pb2_grpc.DraftStub(d_chan)), metrics


@pytest.fixture(scope="module")
def cluster(cluster_and_metrics):
    return cluster_and_metrics[0]


@pytest.fixture(scope="module")
def target_metrics(cluster_and_metrics):
    return cluster_and_metrics[1]


def generated_tokens(metrics: str) -> float:
    """Tokens the target has committed so far, over all requests (its /metrics)."""
    return total(scrape(metrics), "vllm:generation_tokens_total")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_remote_output_equals_single_process_loop(cluster, llama_dir, draft_dir, sampled):
    stub, _ = cluster
    req = request_for(0, prompts(1)[0], gamma=4, max_tokens=40, sampled=sampled)
    assert run_remote(stub, req) == run_local(llama_dir, draft_dir, req)


@pytest.fixture(scope="module")
def overlap_cluster(llama_dir, draft_dir):
    with outrider_process("draft-worker", "--model", str(draft_dir), token=TOKEN) as (_, d_addr), \
         outrider_process("target-worker", "--model", str(llama_dir), "--draft-address", d_addr,
                          "--overlap-max-seqs", "64", token=TOKEN) as (_, t_addr), \
         grpc.insecure_channel(t_addr) as t_chan, grpc.insecure_channel(d_addr) as d_chan:
        yield worker_pb2_grpc.TargetStub(t_chan), worker_pb2_grpc.DraftStub(d_chan)


def test_overlapped_replicas_match_the_overlapped_loop(overlap_cluster, llama_dir, draft_dir):
    """Drafting ahead over gRPC: greedy and seeded sampling give the in-process loop's
    tokens, 12 streams at once give their solo tokens, and nothing is left held."""
    stub, draft = overlap_cluster
    reqs = [request_for(i, p, gamma=(1, 3)[i % 2], max_tokens=12 + 3 * i, sampled=i % 3 == 1)
            for i, p in enumerate(prompts(12, seed=4))]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda r: run_remote(stub, r), reqs))
    for i in (0, 1):
        assert together[i] == run_local(llama_dir, draft_dir, reqs[i], overlap=True)
        assert run_remote(stub, reqs[i]) == together[i]
    assert [len(t) for t in together] == [r.max_tokens for r in reqs]
    _wait_idle(stub, draft)


def test_32_concurrent_sequences_match_their_solo_runs(cluster, llama_dir, draft_dir):
    stub, _ = cluster
    reqs = [request_for(i, p, gamma=(0, 2, 4, 7)[i % 4], max_tokens=8 + (i * 7) % 30,
                        sampled=i % 3 == 0) for i, p in enumerate(prompts(32))]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda r: run_remote(stub, r), reqs))
    solo = [run_remote(stub, r) for r in reqs[:6]]
    assert together[:6] == solo
    for req, tokens in zip(reqs, together):
        assert len(tokens) == req.max_tokens
    assert together[1] == run_local(llama_dir, draft_dir, reqs[1])


def test_cancel_mid_stream_frees_everything(cluster, target_metrics):
    stub, draft = cluster
    _wait_idle(stub, draft)
    before = generated_tokens(target_metrics)
    req = request_for(7, prompts(1)[0], gamma=4, max_tokens=400, sampled=False)
    stream = stub.Generate(req, metadata=token_metadata(TOKEN), timeout=120)
    first = next(stream)
    assert not first.finish_reason  # still running when it is cancelled ...
    assert stub.Cancel(pb.CancelRequest(request_id=req.request_id),
                       metadata=token_metadata(TOKEN)).found  # ... and the replica has it
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    received = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
    assert received < req.max_tokens
    _wait_idle(stub, draft)  # its KV blocks and the draft's sequence are freed
    assert generated_tokens(target_metrics) - before == received  # nothing ran on unseen


def test_client_disconnect_frees_everything(cluster, target_metrics):
    stub, draft = cluster
    _wait_idle(stub, draft)
    before = generated_tokens(target_metrics)
    req = request_for(8, prompts(1)[0], gamma=4, max_tokens=400, sampled=False)
    stream = stub.Generate(req, metadata=token_metadata(TOKEN), timeout=120)
    assert not next(stream).finish_reason  # still running when the client goes
    stream.cancel()
    _wait_idle(stub, draft)
    # it stopped where the client left, not at its length (the replica went on for nobody)
    assert 0 < generated_tokens(target_metrics) - before < req.max_tokens


def _wait_idle(stub, draft, timeout: float = 30) -> None:
    """Until nothing is held: no running sequence, every KV block free, no draft
    sequence (AssertionError with what is held after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = stub.GetLoad(pb.LoadRequest(), metadata=token_metadata(TOKEN))
        stats = draft.Stats(pb.DraftStatsRequest(), metadata=token_metadata(TOKEN))
        if (load.kv_used_blocks, load.num_running, load.num_waiting,
                stats.num_sequences) == (0, 0, 0, 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"resources still held: {load} {stats}")


def test_kv_pressure_preempts_and_finishes_everything(llama_dir, draft_dir):
    """A KV cache too small for the batch: sequences are preempted (their KV freed,
    recomputed later), and every request still gets exactly its tokens. The replica
    runs in this process (the worker's own start()), so that its scheduler's count of
    preemptions can be read: neither GetLoad nor /metrics tells it."""
    from outrider.target_worker.main import TargetWorkerConfig, start
    from outrider.target_worker.scheduler import SchedulerConfig

    reqs = [request_for(i, p, gamma=3, max_tokens=60, sampled=False)
            for i, p in enumerate(prompts(12, seed=4))]
    cfg = TargetWorkerConfig(RunnerConfig(str(llama_dir), kv_cache_mb=0.15, threads=1),
                             SchedulerConfig(max_batch_tokens=64))
    with outrider_process("draft-worker", "--model", str(draft_dir), token=TOKEN) as (_, d):
        running = start(dataclasses.replace(cfg, draft_addresses=(d,)), TOKEN)
        try:
            with grpc.insecure_channel(running.address) as chan:
                stub = worker_pb2_grpc.TargetStub(chan)
                with ThreadPoolExecutor(12) as pool:
                    outputs = list(pool.map(lambda r: run_remote(stub, r), reqs))
                load = stub.GetLoad(pb.LoadRequest(), metadata=token_metadata(TOKEN))
            num_preemptions = running.service.engine.scheduler.num_preemptions
        finally:
            running.stop(0)
    assert num_preemptions > 0  # the pressure it is named for was there
    assert (load.num_running, load.num_waiting, load.kv_used_blocks) == (0, 0, 0)
    for req, tokens in zip(reqs[:3], outputs[:3]):
        assert tokens == run_local(llama_dir, draft_dir, req)
    assert all(len(t) == 60 for t in outputs)


def test_wrong_token_and_bad_request(cluster):
    stub, _ = cluster
    req = request_for(9, [1, 2, 3], gamma=2, max_tokens=5, sampled=False)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, metadata=token_metadata("nope"), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = request_for(10, [1, 2, VOCAB + 5], gamma=2, max_tokens=5, sampled=False)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(bad, metadata=token_metadata(TOKEN), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in err.value.details()
    threading.Event().wait(0)  # keep the module's imports honest


def test_draft_killed_and_restarted_mid_generation(tmp_path, tokenizer_dir):
    """γ = 0 while the draft is gone, MISS and a full resend after it returns: the
    output does not change and speculation resumes in the same sequence."""
    from outrider.launch import free_port
    from tests.checkpoints import perturbed_copy, save_random_checkpoint

    # a long context, so the sequence is still running when the draft is back
    llama_dir = save_random_checkpoint(tmp_path / "t", tokenizer_from=tokenizer_dir,
                                       max_position_embeddings=4096)
    draft_dir = perturbed_copy(llama_dir, tmp_path / "d", noise=0.1)
    port, metrics = free_port(), f"127.0.0.1:{free_port()}"
    draft_args = ("draft-worker", "--model", str(draft_dir), "--port", str(port))
    req = request_for(11, prompts(1, seed=2)[0], gamma=4, max_tokens=2500, sampled=False)
    tokens, rounds_after_gap, is_gap_seen = [], [], False
    with outrider_process(*draft_args, token=TOKEN) as (draft_proc, d_addr), \
         outrider_process("target-worker", "--model", str(llama_dir), "--draft-address", d_addr,
                          token=TOKEN) as (_, t_addr), grpc.insecure_channel(t_addr) as chan:
        stub = worker_pb2_grpc.TargetStub(chan)
        stream = stub.Generate(req, metadata=token_metadata(TOKEN), timeout=120)
        tokens.extend(next(stream).token_ids)
        # plain-decoding company in the batch makes each step slower, so that the
        # sequence outlasts a cold restart of the draft process however slow the machine
        company = [stub.Generate(request_for(100 + i, p, gamma=0, max_tokens=3000,
                                             sampled=False), metadata=token_metadata(TOKEN))
                   for i, p in enumerate(prompts(4, seed=3))]
        draft_proc.kill()
        draft_proc.wait()
        with outrider_process(*draft_args, "--metrics-port", metrics.rsplit(":", 1)[1],
                              token=TOKEN):
            # the rounds before the kill may still be in flight: a round that drafted
            # nothing (the draft gone) comes after them, and every model draft after it
            # is the new process's
            for chunk in stream:
                tokens.extend(chunk.token_ids)
                if is_gap_seen:
                    rounds_after_gap.extend(chunk.rounds)
                is_gap_seen = is_gap_seen or any(r.gamma == 0 for r in chunk.rounds)
                if drafts_accepted(rounds_after_gap):  # the draft is back, if it drafted
                    proposals = total(scrape(metrics), "outrider_draft_proposals_total")
                    if proposals > 0:
                        break
                    # the gap came before the kill (a round that drafted nothing for
                    # another reason) and so did these drafts: wait for the kill's gap
                    is_gap_seen, rounds_after_gap = False, []
            stream.cancel()
            for call in company:
                call.cancel()
            proposals = total(scrape(metrics), "outrider_draft_proposals_total")
    # the new draft process serves the same sequence (the company never speculates): it
    # drafted for it, and its drafts were accepted
    assert proposals > 0, proposals
    assert is_gap_seen and drafts_accepted(rounds_after_gap), rounds_after_gap[-3:]
    # ... and what was served, through the kill and the return, is the single-process output
    req.max_tokens = len(tokens)
    assert tokens == run_local(llama_dir, draft_dir, req)


def drafts_accepted(rounds) -> bool:
    """A round whose model-drafted tokens were accepted (looked-up proposals do not count:
    `auto` makes them with no draft at all)."""
    return any(r.gamma > r.num_free and r.num_accepted > r.num_free for r in rounds)


def test_dense_q_over_torch_distributed(llama_dir, draft_dir):
    """Full-vocabulary sampling with the co-located draft's q sent as fp32 over a gloo
    pair channel: the same tokens as the single-process loop."""
    from outrider.launch import free_port

    dist_address = f"127.0.0.1:{free_port()}"
    reqs = [request_for(20 + i, p, gamma=4, max_tokens=24, sampled=False)
            for i, p in enumerate(prompts(3, seed=5))]
    for req in reqs:  # full vocabulary: temperature only
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed = 1.0, 1.0, 77
    with outrider_process("draft-worker", "--model", str(draft_dir), "--dist-address",
                          dist_address, token=TOKEN) as (_, d), \
         outrider_process("target-worker", "--model", str(llama_dir), "--draft-address", d,
                          "--draft-dist-address", dist_address, token=TOKEN) as (_, t), \
         grpc.insecure_channel(t) as chan, grpc.insecure_channel(d) as d_chan:
        stub = worker_pb2_grpc.TargetStub(chan)
        # the pair joins in the background: on a loaded machine the first requests may all
        # finish over gRPC before it is ready, so they run again until q has gone dense
        deadline = time.monotonic() + 60
        while True:
            with ThreadPoolExecutor(3) as pool:
                outputs = list(pool.map(lambda r: run_remote(stub, r), reqs))
            stats = worker_pb2_grpc.DraftStub(d_chan).Stats(pb.DraftStatsRequest(),
                                                            metadata=token_metadata(TOKEN))
            if stats.num_dense_sends > 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert stats.num_dense_sends > 0
    assert outputs == [run_local(llama_dir, draft_dir, r) for r in reqs]


def test_many_open_streams_leave_room_for_load_and_cancel(cluster):
    stub, _ = cluster
    reqs = [request_for(40 + i, [5, 6, 7], gamma=0, max_tokens=400, sampled=False)
            for i in range(20)]
    streams = [stub.Generate(r, metadata=token_metadata(TOKEN), timeout=120) for r in reqs]
    for s in streams:
        next(s)
    load = stub.GetLoad(pb.LoadRequest(), metadata=token_metadata(TOKEN), timeout=30)
    assert load.num_running + load.num_waiting >= 1
    for r in reqs:
        stub.Cancel(pb.CancelRequest(request_id=r.request_id), metadata=token_metadata(TOKEN),
                    timeout=30)
    assert all(list(s)[-1].finish_reason == "cancelled" for s in streams)


def test_unseeded_sampling_differs_between_requests(cluster):
    stub, _ = cluster
    req = request_for(50, [5, 6, 7], gamma=2, max_tokens=16, sampled=True)
    req.sampling.ClearField("seed")
    outputs = {tuple(run_remote(stub, req)) for _ in range(3)}
    assert len(outputs) > 1


def test_sigterm_with_an_open_stream_stops_the_worker(llama_dir):
    """SIGTERM drains (grpc_server.serve_until_signalled: a 5 s grace): the stream in
    flight runs to its last token; then the worker exits, and cleanly. The stream fits the
    grace on a busy machine: its 100 tokens took at most 1.5 s more beside three busy
    processes and three other workers streaming on 2 cores (120: 2.9 s; 450 took 2 s
    alone, 3.5-4.7 s beside three busy processes, and beside the workers too ran past the
    grace and were cut)."""
    with outrider_process("target-worker", "--model", str(llama_dir), token=TOKEN) as (p, t), \
         grpc.insecure_channel(t) as chan:
        stub = worker_pb2_grpc.TargetStub(chan)
        req = request_for(60, [5, 6, 7], gamma=0, max_tokens=100, sampled=False)
        stream = stub.Generate(req, metadata=token_metadata(TOKEN), timeout=60)
        first = next(stream)
        assert not first.finish_reason
        assert stub.GetLoad(pb.LoadRequest(), metadata=token_metadata(TOKEN),
                            timeout=10).num_running == 1  # it runs when the signal comes
        p.terminate()
        rest = list(stream)  # a stream cut off instead would raise here
        assert p.wait(timeout=60) == 0
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == req.max_tokens


def test_serve_stream_multiplexes_requests_one_message_per_step(cluster, llama_dir, draft_dir):
    """A router's Serve stream: several requests start on one stream, each engine step
    answers with ONE message carrying every running request's part; a bad request gets
    its own error while the others go on; a cancel stops only its request; closing the
    stream cancels what still runs on it."""
    stub, draft = cluster
    reqs = [request_for(40 + i, p, gamma=3, max_tokens=30, sampled=i == 1)
            for i, p in enumerate(prompts(3, seed=6))]
    bad = pb.TargetRequest(request_id="bad", prompt_ids=[VOCAB + 5], max_tokens=4)
    long = request_for(50, prompts(1, seed=7)[0], gamma=3, max_tokens=400, sampled=False)
    outbox = [pb.ServeRequest(start=r) for r in [*reqs, bad, long]]
    sent = threading.Event()

    def requests():
        yield from outbox
        sent.wait(60)  # keep the stream open until the test is done
        yield pb.ServeRequest(cancel=pb.CancelRequest(request_id=long.request_id))
        time.sleep(0.5)

    tokens: dict[str, list[int]] = {r.request_id: [] for r in [*reqs, long]}
    finish, errors, max_outputs = {}, {}, 0
    for step in stub.Serve(requests(), metadata=token_metadata(TOKEN), timeout=120):
        max_outputs = max(max_outputs, len({o.request_id for o in step.outputs}))
        for out in step.outputs:
            if out.error_code:
                errors[out.request_id] = (out.error_code, out.error_message)
                continue
            tokens[out.request_id] += out.chunk.token_ids
            if out.chunk.finish_reason:
                finish[out.request_id] = out.chunk.finish_reason
        if all(r.request_id in finish for r in reqs):
            sent.set()
        if long.request_id in finish:
            break
    assert errors["bad"][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "outside the vocabulary" in errors["bad"][1]
    assert max_outputs >= 2  # requests really share step messages
    for r in reqs:
        assert finish[r.request_id] == "length"
        assert tokens[r.request_id] == run_local(llama_dir, draft_dir, r)
    assert finish[long.request_id] == "cancelled" and len(tokens[long.request_id]) < 400
    _wait_idle(stub, draft)


def test_closing_a_serve_stream_cancels_its_requests(cluster, target_metrics):
    stub, draft = cluster
    _wait_idle(stub, draft)
    before = generated_tokens(target_metrics)
    req = request_for(60, prompts(1, seed=8)[0], gamma=3, max_tokens=400, sampled=False)
    steps = stub.Serve(iter([pb.ServeRequest(start=req)]), metadata=token_metadata(TOKEN),
                       timeout=120)
    first = next(steps).outputs[0]
    assert first.request_id == req.request_id and not first.chunk.finish_reason
    steps.cancel()  # the router went away
    _wait_idle(stub, draft)
    # the replica stopped it when the stream closed, not at its length
    assert 0 < generated_tokens(target_metrics) - before < req.max_tokens


def generate_at_once(address: str, reqs: list[pb.TargetRequest]) -> list[list]:
    """Every request's chunks, the requests streamed at once."""
    with grpc.insecure_channel(address) as chan:
        stub = worker_pb2_grpc.TargetStub(chan)
        with ThreadPoolExecutor(len(reqs)) as pool:
            return list(pool.map(lambda r: list(stub.Generate(
                r, metadata=token_metadata(TOKEN), timeout=120)), reqs))


def outputs_of(chunks: list[list]) -> list[list[int]]:
    return [[t for c in cs for t in c.token_ids] for cs in chunks]


def greedy_alone(target_dir, reqs: list[pb.TargetRequest]) -> list[list[int]]:
    """The target's greedy output alone, fp32 (the requests' max_tokens)."""
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(target_dir), dtype="float32")))
    return [s.output_ids for s in decoder.generate(
        [list(r.prompt_ids) for r in reqs],
        [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs], 0)]


def test_a_replica_verifies_a_heads_trees_under_kv_pressure():
    """The replica with the shipped EAGLE-3 head drafting trees (top-k 3, 12 nodes) in its
    process, AUTO and FIXED requests at once (two with shapes of their own) in a KV cache
    too small for them (its scheduler counts a tree's nodes, and preempted sequences
    recompute their features):
    every output is the target's greedy output alone, and the rounds kept drafts."""
    from outrider.target_worker.main import TargetWorkerConfig, start
    from outrider.target_worker.scheduler import SchedulerConfig

    from outrider.core.tokenizer import Tokenizer
    from outrider.paths import models_dir

    target_dir, head_dir = models_dir() / "demo-target", models_dir() / "demo-eagle3"
    tokenizer = Tokenizer(target_dir)
    texts = ["def fibonacci(n):\n", "import os\n\ndef walk(path):\n", "class Node:\n",
             "for i in range(10):\n", "def merge_sort(xs):\n", "    return self."]
    reqs = [request_for(i, tokenizer.encode(t), gamma=4, max_tokens=40, sampled=False)
            for i, t in enumerate(texts)]
    for req in reqs[::2]:
        req.spec_mode = pb.SPEC_MODE_AUTO
    reqs[1].tree_topk = 1  # requests' own shapes: a chain, and a smaller tree
    reqs[3].tree_topk, reqs[3].tree_tokens = 2, 5
    cfg = TargetWorkerConfig(RunnerConfig(str(target_dir), dtype="float32", kv_cache_mb=0.6,
                                          threads=1),
                             SchedulerConfig(max_batch_tokens=96), draft_head=str(head_dir),
                             tree_topk=3, tree_tokens=12)
    running = start(cfg, TOKEN)
    # greedy rounds draft trees every step (no TreeChoice, which may pick chains for a
    # while by timing), so that the requests' own shapes are verified as trees
    running.service.engine.decoder.tree_choice = None
    tree_nodes = lambda: REGISTRY.get_sample_value(  # noqa: E731
        "outrider_spec_tree_nodes_total", {"model_name": "demo-target", "engine": "0"}) or 0
    head_tokens = lambda: REGISTRY.get_sample_value(  # noqa: E731
        "vllm:spec_decode_num_draft_tokens_total",
        {"model_name": "demo-target", "engine": "0", "method": "eagle3"}) or 0
    nodes_before, head_before = tree_nodes(), head_tokens()
    try:
        chunks = generate_at_once(running.address, reqs)
        num_preemptions = running.service.engine.scheduler.num_preemptions
    finally:
        running.stop(0)
    assert tree_nodes() > nodes_before  # trees ran, and /metrics counts their nodes
    # the head's drafts count under its method, as vLLM names it, in rounds and /metrics
    rounds = [r for cs in chunks for c in cs for r in c.rounds]
    assert {r.model_method for r in rounds if r.gamma > r.num_free} == {"eagle3"}
    # a tree round reports its nodes beside its depth (γ), and kept nodes past its chain
    assert any(r.tree_nodes > r.gamma > 0 for r in rounds)
    # the requests' own shapes: a chain; a tree (nodes past its depth) of at most 5 nodes
    own = [[(r.gamma, r.tree_nodes) for c in chunks[i] for r in c.rounds] for i in (1, 3)]
    assert not any(nodes for _, nodes in own[0]), own[0]
    assert any(nodes > depth > 0 for depth, nodes in own[1]), own[1]
    assert max(nodes for _, nodes in own[1]) <= 5, own[1]
    assert head_tokens() > head_before
    assert num_preemptions > 0
    assert outputs_of(chunks) == greedy_alone(target_dir, reqs)
    accepted = sum(r.num_accepted for cs in chunks for c in cs for r in c.rounds)
    assert accepted > 40, accepted


def test_a_head_on_a_draft_replica_drafts_from_the_features_sent_with_propose():
    """The shipped EAGLE-3 head on a draft replica (the target's embedding loaded there),
    the target sending each Propose the features fused by the head's fc: greedy output is
    the target's alone, FIXED and AUTO at once; the rounds count under eagle3 and kept
    drafts. A target given no head, or features of the wrong width, are refused by name."""
    from outrider.target_worker.main import TargetWorkerConfig, start
    from outrider.target_worker.remote_drafter import DraftReplicaError

    from outrider.core.tokenizer import Tokenizer
    from outrider.paths import models_dir

    target_dir, head_dir = models_dir() / "demo-target", models_dir() / "demo-eagle3"
    tokenizer = Tokenizer(target_dir)
    texts = ["def fibonacci(n):\n", "import os\n\ndef walk(path):\n", "class Node:\n",
             "for i in range(10):\n"]
    reqs = [request_for(i, tokenizer.encode(t), gamma=4, max_tokens=40, sampled=False)
            for i, t in enumerate(texts)]
    reqs[1].spec_mode = pb.SPEC_MODE_AUTO
    runner = RunnerConfig(str(target_dir), dtype="float32", kv_cache_mb=4, threads=1)
    with outrider_process("draft-worker", "--model", str(head_dir), "--target-model",
                          str(target_dir), "--dtype", "float32", "--threads", "1",
                          token=TOKEN) as (_, d_addr), grpc.insecure_channel(d_addr) as d_chan:
        with pytest.raises(DraftReplicaError, match="run a eagle3 .* was given no head"):
            start(TargetWorkerConfig(runner, draft_addresses=(d_addr,)), TOKEN)
        draft = worker_pb2_grpc.DraftStub(d_chan)
        wrong = pb.ProposeSequence(seq_id="w", new_token_ids=[5, 6], gamma=2,
                                   q_format=pb.Q_FORMAT_IDS, features=pb.Features(
                                       data=bytes(2 * 7 * 4), width=7,
                                       dtype=pb.FEATURE_DTYPE_FP32))
        with pytest.raises(grpc.RpcError) as err:
            draft.Propose(pb.ProposeRequest(sequences=[wrong]), metadata=token_metadata(TOKEN))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "features.width is 7" in err.value.details()
        running = start(TargetWorkerConfig(runner, draft_addresses=(d_addr,),
                                           draft_head=str(head_dir)), TOKEN)
        try:
            chunks = generate_at_once(running.address, reqs)
        finally:
            running.stop(0)
    rounds = [r for cs in chunks for c in cs for r in c.rounds]
    assert {r.model_method for r in rounds if r.gamma > r.num_free} == {"eagle3"}
    assert outputs_of(chunks) == greedy_alone(target_dir, reqs)
    head_rounds = [r for r in rounds if r.model_method == "eagle3" and r.gamma]
    accepted = sum(r.num_accepted for r in head_rounds)
    assert accepted > len(head_rounds), (accepted, len(head_rounds))  # > 1 a round


def test_a_replica_with_no_draft_speculates_with_its_own_layers(llama_dir, tmp_path,
                                                                monkeypatch):
    """--self-draft-layers auto: the replica searches its layers (once, kept on disk) and
    drafts through the best subset in its process; FIXED and AUTO requests, greedy, give
    the target's output alone, their rounds and /metrics count the drafts as layer_skip."""
    from outrider.target_worker.main import TargetWorkerConfig, start

    monkeypatch.setenv("OUTRIDER_LAYER_SKIP_CACHE", str(tmp_path))
    reqs = [request_for(i, p, gamma=3, max_tokens=24, sampled=False)
            for i, p in enumerate(prompts(4))]
    reqs[0].spec_mode = reqs[2].spec_mode = pb.SPEC_MODE_AUTO
    drafted = lambda: REGISTRY.get_sample_value(  # noqa: E731
        "vllm:spec_decode_num_draft_tokens_total",
        {"model_name": llama_dir.name, "engine": "0", "method": "layer_skip"}) or 0
    before = drafted()
    running = start(TargetWorkerConfig(RunnerConfig(str(llama_dir), dtype="float32",
                                                    threads=1), self_draft_layers="auto"),
                    TOKEN)
    try:
        chunks = generate_at_once(running.address, reqs)
    finally:
        running.stop(0)
    assert len(list(tmp_path.glob("*.json"))) == 1  # the search's choice, kept
    rounds = [r for cs in chunks for c in cs for r in c.rounds if r.gamma > r.num_free]
    assert rounds and {r.model_method for r in rounds} == {"layer_skip"}
    assert drafted() > before
    assert outputs_of(chunks) == greedy_alone(llama_dir, reqs)
