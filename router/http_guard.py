"""Bounds on what an HTTP client may make the router hold (docs/RELIABILITY.md):

- request headers must arrive within `header_timeout_s` of connecting (or of the previous
  response on a kept-alive connection), else the connection is closed: uvicorn bounds
  only the idle time between requests, so a client trickling headers held one forever;
- a body must arrive whole within `body_timeout_s` of its headers (408 and closed) and
  be at most `max_body_bytes` (413, refused from Content-Length before a byte is read);
- the app sees a body only once it is complete, so no handler waits on a slow client;
- large blocks are mapped on their own and, after a large body, unreachable objects are
  collected and the C allocator returns its free memory to the system: a burst of big
  refused requests left the router 2.9x its size (88 -> 253 MB), now ~1.2x;
- a streamed response's client must keep reading (ReadWatch): bytes waiting for it and
  none acknowledged by its TCP for `unread_timeout_s` stop its generations, however many
  events the buffers hold; each connection's kernel send buffer is capped besides
  (SEND_BUFFER_BYTES: left to autotune it took megabytes on loopback, a whole stream).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import fcntl
import functools
import gc
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from outrider.router.refusal import Refused
from uvicorn.protocols.http.h11_impl import H11Protocol

TRIM_AFTER_BYTES = 1 << 20  # bodies this large are followed by a malloc_trim
MMAP_THRESHOLD_BYTES = 1 << 20  # larger blocks are mapped on their own, unmapped when freed
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
SEND_BUFFER_BYTES = 64 << 10  # per connection (the kernel doubles it)
READ_CHECK_S = 0.5  # how often a streaming connection's reading is checked
SIOCOUTQ = 0x5411  # Linux ioctl: bytes of a socket's send queue its peer has not acknowledged
TCP_INFO_LEN, BYTES_ACKED_AT = 128, 120  # struct tcp_info's u64 tcpi_bytes_acked (Linux 4.1)
READ_WATCH = "outrider.read_watch"  # the scope key of a request's connection's ReadWatch


@dataclass(frozen=True)
class HttpBounds:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 16 << 20


class ReadWatch:
    """Whether a connection's client reads what it is sent, judged by time: bytes wait for
    it (in the transport or the kernel) and its TCP acknowledged none of them for
    `timeout_s`. A peer acknowledges only what fits its receive buffer, so one that stops
    reading is seen within seconds of its buffer filling, whatever the size of the events;
    one that reads slowly acknowledges again each time it frees a segment or a sixteenth
    of its buffer. Without TCP_INFO (not Linux) it never fires: the pumps' bound holds."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 timeout_s: float) -> None:
        self.transport, self.loop, self.timeout_s = transport, loop, timeout_s
        self._on_stall: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._acked, self._progress_at = 0, 0.0

    def sees_reads(self) -> bool:
        return self._bytes_acked() is not None

    def watch(self, on_stall: Callable[[], None]) -> Callable[[], None]:
        """Call `on_stall` once, on the event loop, if the client stops reading; returns
        what stops watching (the response ended). Called on the event loop."""
        self._on_stall.append(on_stall)
        if self._timer is None:
            self._acked, self._progress_at = self._bytes_acked(), self.loop.time()
            self._timer = self.loop.call_later(READ_CHECK_S, self._check)

        def stop() -> None:
            if on_stall in self._on_stall:
                self._on_stall.remove(on_stall)
        return stop

    def _check(self) -> None:
        self._timer = None
        acked = self._bytes_acked()
        if not self._on_stall or acked is None or self.transport.is_closing():
            return
        now = self.loop.time()
        if acked != self._acked or not self._is_waiting():
            self._acked, self._progress_at = acked, now
        elif now - self._progress_at >= self.timeout_s:
            stalled, self._on_stall = self._on_stall, []
            for on_stall in stalled:
                on_stall()
            return
        self._timer = self.loop.call_later(READ_CHECK_S, self._check)

    def _is_waiting(self) -> bool:
        if self.transport.get_write_buffer_size() > 0:
            return True
        sock = self.transport.get_extra_info("socket")
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, b"\0" * 4))[0] > 0
        except (OSError, AttributeError):
            return False

    def _bytes_acked(self) -> int | None:
        sock = self.transport.get_extra_info("socket")
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
        except (OSError, AttributeError):  # no socket, or no TCP_INFO on this system
            return None
        if len(info) < TCP_INFO_LEN:
            return None
        return int.from_bytes(info[BYTES_ACKED_AT:TCP_INFO_LEN], "little")


def guarded_protocol(header_timeout_s: float, unread_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, closing connections whose headers come too slowly and
    giving each request's scope its connection's ReadWatch (READ_WATCH)."""

    class GuardedProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self.read_watch = ReadWatch(transport, self.loop, unread_timeout_s)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._is_in_request:
                self._stop_waiting()
                self.cycle.scope[READ_WATCH] = self.read_watch  # before its app task runs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()

        def connection_lost(self, exc) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        @property
        def _is_in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _await_headers(self) -> None:
            self._stop_waiting()
            if not self._is_in_request and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s,
                                                          self.timeout_keep_alive_handler)

        def _stop_waiting(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

    return GuardedProtocol


class BodyGuard:
    """ASGI middleware: the whole body, bounded in size and time, before the app runs.
    `refuse` turns a Refused into the API's error response (an ASGI app)."""

    def __init__(self, app, bounds: HttpBounds, refuse: Callable[[Refused], object]) -> None:
        self.app, self.bounds, self.refuse = app, bounds, refuse
        _map_large_blocks_alone()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_length(scope)
            body = await asyncio.wait_for(self._read_body(receive), self.bounds.body_timeout_s)
        except TimeoutError:
            await self._close_with(Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request body did not arrive within {self.bounds.body_timeout_s:g} s"),
                408, scope, receive, send)
            return
        except Refused as refusal:
            await self._close_with(refusal, 413, scope, receive, send)
            return
        try:
            await self.app(scope, _replaying(body, receive), send)
        finally:
            if len(body) >= TRIM_AFTER_BYTES:
                del body
                _return_free_memory()

    def _check_length(self, scope) -> None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.bounds.max_body_bytes:
            raise self._too_large()

    async def _read_body(self, receive) -> bytes:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""  # the app finds the client gone
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.bounds.max_body_bytes:
                raise self._too_large()
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self) -> Refused:
        return Refused(grpc.StatusCode.INVALID_ARGUMENT,
                       f"the request body is larger than {self.bounds.max_body_bytes} bytes")

    async def _close_with(self, refusal: Refused, status: int, scope, receive, send) -> None:
        response = self.refuse(refusal)
        response.status_code = status
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _replaying(body: bytes, receive):
    """A receive that gives the app the body once, then what the client sends next."""
    is_sent = False

    async def replay():
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _map_large_blocks_alone() -> None:
    """A fixed mmap threshold: glibc raises it after every large free, so large bodies
    would come from the heap and stay there, fragmented, after a burst."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):  # glibc only
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def _return_free_memory() -> None:
    """What a large request left behind, back to the system: its objects (an exception's
    traceback can hold a refused request in a reference cycle until the next full
    collection), then the allocator's free pages."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)
