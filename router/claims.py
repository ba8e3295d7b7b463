"""Claims on the journals of the requests this router runs.

A request id is the client's idempotency key: while one router runs the request, a
retry anywhere gets ALREADY_EXISTS. The claim that says so lives in the shared store
with a short lease, renewed here for as long as the request runs; a router that dies
stops renewing, so its requests' ids free up within one lease instead of holding until
the journal's TTL runs out."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from outrider.state import StoreUnavailable


class ClaimKeeper:
    def __init__(self, store, lease_s: float) -> None:
        self.store, self.lease_s = store, lease_s
        self._request_ids: set[str] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._renew_forever, name="journal-claims",
                                        daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def holding(self, request_id: str) -> Iterator[None]:
        """Keep the claim on `request_id` alive while the block runs."""
        with self._lock:
            self._request_ids.add(request_id)
        try:
            yield
        finally:
            with self._lock:
                self._request_ids.discard(request_id)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _renew_forever(self) -> None:
        # three renewals per lease: one lost to a Redis blip does not drop a claim
        while not self._stopped.wait(self.lease_s / 3):
            with self._lock:
                request_ids = sorted(self._request_ids)
            with contextlib.suppress(StoreUnavailable):
                self.store.journal_renew(request_ids, self.lease_s)
