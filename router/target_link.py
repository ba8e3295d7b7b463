"""A router's link to one target replica: one long-lived Serve stream carries every
request this router runs there. Starts and cancels go out on it; each engine step comes
back as ONE message holding what the step committed for all of them, and a reader
thread hands each request its part. A stream that breaks fails every request on it
(they move to another replica); the next request opens a new one."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# Backpressure: a request whose reader (its client, through the service) has chunks
# waiting and takes none for this long is cancelled on the replica: a client that stops
# reading stops costing the engine within seconds (docs/RELIABILITY.md)
UNREAD_TIMEOUT_S = 5.0
UNREAD = f"the client read nothing of its stream for {UNREAD_TIMEOUT_S:g} s: it was cancelled"


class ReplicaCallError(grpc.RpcError):
    """A request's failure on a replica (its own, or its stream's), read like the error
    of a gRPC call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StreamUnread(ReplicaCallError):
    """The request's reader stopped reading: it was cancelled to spare the replica."""


class RequestFeed:
    """What one request receives over a link."""

    def __init__(self, stream: _Stream, request_id: str) -> None:
        self._stream, self.request_id = stream, request_id
        self._items: queue.Queue[pb.TargetChunk | ReplicaCallError] = queue.Queue()
        self.is_done = False
        self._last_read = time.monotonic()
        self._is_reading = False  # the reader waits for a chunk: nothing is left unread
        # None: its reader judges its client's reading itself (the HTTP API's ReadWatch)
        self.unread_timeout_s: float | None = UNREAD_TIMEOUT_S

    def put(self, item: pb.TargetChunk | ReplicaCallError) -> None:
        self._items.put(item)
        if self._is_unread():
            self._stop(StreamUnread(grpc.StatusCode.CANCELLED, UNREAD))

    def _is_unread(self) -> bool:
        return (self.unread_timeout_s is not None and not self.is_done
                and not self._is_reading
                and time.monotonic() - self._last_read >= self.unread_timeout_s)

    def chunks(self, timeout_s: float | None) -> Iterator[pb.TargetChunk]:
        """The request's chunks until its last; raises ReplicaCallError when it fails
        or `timeout_s` passes (DEADLINE_EXCEEDED, and the replica is told to stop)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._is_reading = True
            try:
                item = self._items.get(timeout=wait)
                self._last_read = time.monotonic()
                self._is_reading = False
            except queue.Empty:
                self.cancel()
                raise ReplicaCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "Deadline Exceeded") from None
            if isinstance(item, ReplicaCallError):
                self._done()
                raise item
            yield item
            if item.finish_reason:
                self._done()
                return

    def cancel(self) -> None:
        """Stop the request on the replica (nothing once it has finished or failed); a
        reader still waiting for chunks gets CANCELLED, as from a cancelled call."""
        self._stop(ReplicaCallError(grpc.StatusCode.CANCELLED, "Cancelled"))

    def _stop(self, reason: ReplicaCallError) -> None:
        if not self.is_done:
            self._done()
            self._stream.send(pb.ServeRequest(cancel=pb.CancelRequest(
                request_id=self.request_id)))
            self._items.put(reason)

    def _done(self) -> None:
        self.is_done = True
        self._stream.forget(self.request_id)

    def __enter__(self) -> RequestFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class _Stream:
    """One Serve call and the requests riding on it."""

    def __init__(self, stub: worker_pb2_grpc.TargetStub, metadata: tuple) -> None:
        self._outbox: queue.Queue[pb.ServeRequest | None] = queue.Queue()
        self._feeds: dict[str, RequestFeed] = {}
        self._lock = threading.Lock()
        self.is_broken = False
        self._call = stub.Serve(iter(self._outbox.get, None), metadata=metadata)
        threading.Thread(target=self._read, name="target-link", daemon=True).start()

    def start(self, request: pb.TargetRequest) -> RequestFeed:
        feed = RequestFeed(self, request.request_id)
        with self._lock:
            if self.is_broken:
                raise ReplicaCallError(grpc.StatusCode.UNAVAILABLE, "the replica's stream broke")
            self._feeds[request.request_id] = feed
        self.send(pb.ServeRequest(start=request))
        return feed

    @property
    def num_running(self) -> int:
        return len(self._feeds)

    def send(self, message: pb.ServeRequest) -> None:
        self._outbox.put(message)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._feeds.pop(request_id, None)

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()

    def _read(self) -> None:
        try:
            for step in self._call:
                for output in step.outputs:
                    self._hand_out(output)
            failure = ReplicaCallError(grpc.StatusCode.UNAVAILABLE,
                                       "the replica ended the stream")
        except grpc.RpcError as exc:
            failure = ReplicaCallError(exc.code(), exc.details() or "the stream broke")
        with self._lock:
            self.is_broken = True
            feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.put(failure)
        self._outbox.put(None)

    def _hand_out(self, output: pb.StepOutput) -> None:
        with self._lock:
            feed = self._feeds.get(output.request_id)
        if feed is None:
            return  # a request that was cancelled or timed out meanwhile
        if output.error_code:
            feed.put(ReplicaCallError(STATUS_BY_VALUE.get(output.error_code,
                                                          grpc.StatusCode.UNKNOWN),
                                      output.error_message))
        else:
            feed.put(output.chunk)


class TargetLink:
    """The Serve stream to one replica, opened on first use and again after it broke."""

    def __init__(self, stub: worker_pb2_grpc.TargetStub, metadata: tuple) -> None:
        self._stub, self._metadata = stub, metadata
        self._stream: _Stream | None = None
        self._lock = threading.Lock()

    def start(self, request: pb.TargetRequest) -> RequestFeed:
        with self._lock:
            if self._stream is None or self._stream.is_broken:
                self._stream = _Stream(self._stub, self._metadata)
            stream = self._stream
        return stream.start(request)

    @property
    def num_running(self) -> int:
        """Requests this router runs on the replica now."""
        stream = self._stream
        return 0 if stream is None or stream.is_broken else stream.num_running

    def close(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
