"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from outrider.client.channel import (
    DEFAULT_RETRY,
    CallSettings,
    Retry,
    Tls,
    auth_metadata,
    open_channel,
)
from outrider.client.errors import from_rpc_error
from outrider.client.request import build_request
from outrider.client.results import Collector, Delta, Generation
from outrider.client.resume import DEFAULT_RESUME, Resume, Resumption, resumable
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc


class GenerationStream:
    """Iterate for Deltas as they are generated; `result()` gives the whole Generation
    (reading what is left). Leaving a `with` block early cancels the request. A stream
    whose router fails resumes on another (outrider.client.resume)."""

    def __init__(self, open_call, request: gp.GenerateRequest,
                 resume: Resume | None = None) -> None:
        self._open, self._resumption = open_call, Resumption(resume, request)
        self._call, self._collector = open_call(request), Collector()
        self._deltas = self._read()

    def _read(self) -> Iterator[Delta]:
        while True:
            try:
                for msg in self._call:
                    self._resumption.received()
                    yield self._collector.add(msg)
                return
            except grpc.RpcError as exc:
                again = self._resumption.next_request(exc, len(self._collector.token_ids))
                time.sleep(self._resumption.policy.backoff_s)
                self._call = self._open(again)

    def __iter__(self) -> Iterator[Delta]:
        return self._deltas

    def result(self) -> Generation:
        for _ in self._deltas:
            pass
        return self._collector.result()

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Outrider's public gRPC API (protos/outrider/v1/generate.proto).

        with Client("127.0.0.1:50051") as client:
            for delta in client.stream("def fib(n):", max_tokens=64):
                print(delta.text, end="")
            print(client.generate("import os", max_tokens=16).speculation.acceptance_rate)

    Options are build_request's (max_tokens, temperature, top_k, top_p, seed, stop,
    stop_token_ids, ignore_eos, speculation="auto"|"off"|"fixed", gamma_max, request_id,
    tag, include_rounds, proposer="auto"|"model"|"ngram"|"suffix"|"lookahead", tree_topk and
    tree_tokens (its token tree within the replica's; 1: chains), one output constraint:
    json_schema, json_object, regex, choice or grammar, and model, of a router serving
    several). The API key defaults
    to $OUTRIDER_API_KEY.

    `timeout_s` is each call's deadline (None: none; a call may set its own). Calls that
    fail with UNAVAILABLE before any token are retried with backoff (`retry`, through
    the gRPC service config; None: never). `wait_for_ready` (default: when the call has
    a deadline) lets a call wait for an unreachable router, e.g. one restarting, until
    its deadline. A stream that breaks mid-way because its router failed resumes, with
    nothing lost or repeated, on a router sharing its Redis (`resume`; None: never;
    outrider.client.resume). Failures raise the errors in outrider.client.errors.
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls: Tls | None = None, timeout_s: float | None = None,
                 retry: Retry | None = DEFAULT_RETRY,
                 wait_for_ready: bool | None = None,
                 resume: Resume | None = DEFAULT_RESUME) -> None:
        self._channel = open_channel(grpc, address, tls, retry)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self.settings = CallSettings(auth_metadata(api_key), timeout_s, wait_for_ready)
        self.resume = resume

    def stream(self, prompt: str | list[int], *, timeout_s: float | None = None,
               **options) -> GenerationStream:
        request = build_request(prompt, **options)
        if self.resume is not None:
            request = resumable(request)
        return GenerationStream(
            lambda r: self._stub.GenerateStream(r, **self.settings.for_call(timeout_s)),
            request, self.resume)

    def generate(self, prompt: str | list[int], *, timeout_s: float | None = None,
                 **options) -> Generation:
        return self.stream(prompt, timeout_s=timeout_s, **options).result()

    def generate_batch(self, prompts: Iterable[str | list[int]], *, max_concurrency: int = 8,
                       **options) -> list[Generation]:
        """Generations in the prompts' order, up to max_concurrency at a time (the first
        failure raises once the calls already running are done)."""
        with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
            return list(pool.map(lambda p: self.generate(p, **options), prompts))

    def status(self, tag: str = "", *, timeout_s: float | None = None) -> gp.RouterStatus:
        """Replicas (heat, load, KV use) and acceptance statistics per model pair and tag."""
        try:
            return self._stub.Status(gp.StatusRequest(tag=tag),
                                     **self.settings.for_call(timeout_s))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
