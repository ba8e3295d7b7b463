"""Admission control: how many generations the router runs at once, on every surface.

A request costs one slot per generation it asks for: a gRPC call one, an HTTP request
its prompts × n. It starts at once when its slots are free and nobody waits before it;
otherwise it waits in a FIFO queue of bounded size for at most `max_wait_s`. A full
queue, or a wait that runs out, is refused with RESOURCE_EXHAUSTED (HTTP 429) and a
retry hint; a request that could never fit is refused as invalid. Arrival order is kept,
so a large request is not overtaken forever by small ones (docs/DESIGN.md §9.2)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from outrider.router.refusal import Refused


@dataclass
class _Waiter:
    cost: int
    wake: Callable[[], None]
    is_granted: bool = False


class Admission:
    def __init__(self, max_running: int, max_queued: int, max_wait_s: float) -> None:
        self.max_running, self.max_queued, self.max_wait_s = max_running, max_queued, max_wait_s
        self.num_running = 0   # slots held
        self.num_queued = 0    # slots asked for by the waiting requests
        self._queue: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    # -- a thread's request (gRPC) ---------------------------------------------------------
    @contextlib.contextmanager
    def slots(self, cost: int = 1):
        """Hold `cost` slots while the block runs, waiting for them if need be."""
        granted = threading.Event()
        waiter = self._join(cost, granted.set)
        if waiter is not None and not granted.wait(self.max_wait_s) and self._withdraw(waiter):
            raise self._waited_too_long()
        try:
            yield
        finally:
            self.leave(cost)

    # -- an event loop's request (HTTP) ----------------------------------------------------
    async def enter(self, cost: int) -> None:
        """Take `cost` slots (the caller leaves them with `leave`), waiting if need be."""
        loop = asyncio.get_running_loop()
        granted = loop.create_future()
        waiter = self._join(cost, lambda: loop.call_soon_threadsafe(_settle, granted))
        if waiter is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(granted), self.max_wait_s)
        except TimeoutError:
            if self._withdraw(waiter):
                raise self._waited_too_long() from None
        except asyncio.CancelledError:  # the client left while it waited
            if not self._withdraw(waiter):
                self.leave(cost)
            raise

    def leave(self, cost: int) -> None:
        with self._lock:
            self.num_running -= cost
            self._grant_in_order()

    # -- the queue -------------------------------------------------------------------------
    def _join(self, cost: int, wake: Callable[[], None]) -> _Waiter | None:
        """Slots now (None), a place in the queue (its waiter), or a refusal."""
        if cost > self.max_running:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"this request asks for {cost} generations at once (prompts × n); "
                          f"the router runs at most {self.max_running}")
        with self._lock:
            if not self._queue and self.num_running + cost <= self.max_running:
                self.num_running += cost
                return None
            if self.num_queued + cost > self.max_queued:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the router runs its limit of {self.max_running} generations "
                              "and its queue is full", retry_after_s=1.0)
            waiter = _Waiter(cost, wake)
            self._queue.append(waiter)
            self.num_queued += cost
            return waiter

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Leave the queue; False when the slots were granted meanwhile (the caller runs)."""
        with self._lock:
            if waiter.is_granted:
                return False
            self._queue.remove(waiter)
            self.num_queued -= waiter.cost
            self._grant_in_order()  # it may have held back smaller requests behind it
            return True

    def _grant_in_order(self) -> None:
        while self._queue and self.num_running + self._queue[0].cost <= self.max_running:
            waiter = self._queue.popleft()
            self.num_queued -= waiter.cost
            self.num_running += waiter.cost
            waiter.is_granted = True
            waiter.wake()

    def _waited_too_long(self) -> Refused:
        return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the router is at its limit of {self.max_running} generations: "
                       f"waited {self.max_wait_s:g} s in its queue", retry_after_s=1.0)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
