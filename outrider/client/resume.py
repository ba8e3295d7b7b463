"""Resuming a stream whose router failed mid-way (docs/DESIGN.md §9.4).

A stream that breaks after its first message (the router died: UNAVAILABLE) is sent
again, with the same request id, saying how many output tokens the client already has
(`resume_from`). A router sharing the failed one's Redis continues the request from its
journal once the failed router's claim lapses (a few seconds; until then it answers
ALREADY_EXISTS) and sends only what follows: the caller sees one unbroken stream. The
channel's address may name several routers (`ipv4:10.0.0.1:50051,10.0.0.2:50051`) or a
name that resolves to several; a restarted router on the same address serves too."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc

from outrider.client.errors import from_rpc_error
from outrider.v1 import generate_pb2 as gp

BREAKS = {grpc.StatusCode.UNAVAILABLE}  # what a router dying looks like to a stream
# while resuming: the router is still down, or the failed one's claim has not lapsed
NOT_YET = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS}


@dataclass(frozen=True)
class Resume:
    within_s: float = 30.0  # how long a broken stream keeps trying to resume
    backoff_s: float = 0.5  # between attempts


DEFAULT_RESUME = Resume()


def resumable(request: gp.GenerateRequest) -> gp.GenerateRequest:
    """The request with an id of its own (the router's journal knows it by that)."""
    if not request.request_id:
        request.request_id = uuid.uuid4().hex
    return request


def resumed(request: gp.GenerateRequest, num_tokens: int) -> gp.GenerateRequest:
    again = gp.GenerateRequest()
    again.CopyFrom(request)
    again.resume_from = num_tokens
    return again


class Resumption:
    """One stream's attempts: whether a failure is worth another, and when to give up."""

    def __init__(self, policy: Resume | None, request: gp.GenerateRequest) -> None:
        self.policy, self.request = policy, request
        self.num_messages, self._deadline = 0, None

    def received(self) -> None:
        """A message came: a later break gets its own time to resume."""
        self.num_messages += 1
        self._deadline = None

    def next_request(self, exc: grpc.RpcError, num_tokens: int) -> gp.GenerateRequest:
        """The request that resumes after `exc` (the caller waits `policy.backoff_s`
        first); raises `exc` as the SDK's error when the stream cannot resume."""
        if not self._should_retry(exc):
            raise from_rpc_error(exc) from None
        return resumed(self.request, num_tokens)

    def _should_retry(self, exc: grpc.RpcError) -> bool:
        if self.policy is None or not self.num_messages:  # before any: gRPC's own retries
            return False
        if self._deadline is None:
            self._deadline = time.monotonic() + self.policy.within_s
            return exc.code() in BREAKS
        return exc.code() in NOT_YET and time.monotonic() < self._deadline
