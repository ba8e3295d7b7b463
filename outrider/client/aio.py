"""The asyncio client: the same calls as Client, awaitable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

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


class AsyncGenerationStream:
    """`async for` over Deltas; `await result()` gives the whole Generation."""

    def __init__(self, open_call, request: gp.GenerateRequest,
                 resume: Resume | None = None) -> None:
        self._open, self._resumption = open_call, Resumption(resume, request)
        self._call, self._collector = open_call(request), Collector()
        self._deltas = self._read()

    async def _read(self) -> AsyncIterator[Delta]:
        while True:
            try:
                async for msg in self._call:
                    self._resumption.received()
                    yield self._collector.add(msg)
                return
            except grpc.RpcError as exc:
                again = self._resumption.next_request(exc, len(self._collector.token_ids))
                await asyncio.sleep(self._resumption.policy.backoff_s)
                self._call = self._open(again)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas

    async def result(self) -> Generation:
        async for _ in self._deltas:
            pass
        return self._collector.result()

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncClient:
    """Like Client (same options and errors), for asyncio code:

        async with AsyncClient("127.0.0.1:50051") as client:
            async for delta in client.stream("def fib(n):", max_tokens=64):
                print(delta.text, end="")
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls: Tls | None = None, timeout_s: float | None = None,
                 retry: Retry | None = DEFAULT_RETRY,
                 wait_for_ready: bool | None = None,
                 resume: Resume | None = DEFAULT_RESUME) -> None:
        self._channel = open_channel(grpc.aio, address, tls, retry)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self.settings = CallSettings(auth_metadata(api_key), timeout_s, wait_for_ready)
        self.resume = resume

    def stream(self, prompt: str | list[int], *, timeout_s: float | None = None,
               **options) -> AsyncGenerationStream:
        request = build_request(prompt, **options)
        if self.resume is not None:
            request = resumable(request)
        return AsyncGenerationStream(
            lambda r: self._stub.GenerateStream(r, **self.settings.for_call(timeout_s)),
            request, self.resume)

    async def generate(self, prompt: str | list[int], *, timeout_s: float | None = None,
                       **options) -> Generation:
        return await self.stream(prompt, timeout_s=timeout_s, **options).result()

    async def generate_batch(self, prompts: Iterable[str | list[int]], *,
                             max_concurrency: int = 8, **options) -> list[Generation]:
        """Generations in the prompts' order, up to max_concurrency at a time."""
        slots = asyncio.Semaphore(max_concurrency)

        async def one(prompt) -> Generation:
            async with slots:
                return await self.generate(prompt, **options)
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def status(self, tag: str = "", *, timeout_s: float | None = None) -> gp.RouterStatus:
        try:
            return await self._stub.Status(gp.StatusRequest(tag=tag),
                                           **self.settings.for_call(timeout_s))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
