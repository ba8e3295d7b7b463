"""The store for a single router: the shared state's behaviour, in this process."""

from __future__ import annotations

import threading
import time

from outrider.core.stats import AcceptanceCounts
from outrider.state import contract
from outrider.state.contract import Resumable, rate_limit_interval_ms
from outrider.v1 import state_pb2 as st


class MemoryStore:
    """The store for a single router: the same behaviour, in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, tuple[float, bytes]] = {}   # address -> (expiry, record)
        self._acceptance: dict[tuple[str, str], AcceptanceCounts] = {}
        self._keys: dict[str, bytes] = {}
        self._rate_tat: dict[str, float] = {}                  # key hash -> TAT (ms)
        self._journal: dict[str, tuple[float, bytes, list[int]]] = {}

    # -- replica registry ------------------------------------------------------------------
    def put_replica(self, record: st.ReplicaRecord, ttl_s: float) -> None:
        with self._lock:
            self._replicas[record.address] = (time.monotonic() + ttl_s,
                                              record.SerializeToString())

    def replicas(self) -> list[st.ReplicaRecord]:
        now = time.monotonic()
        with self._lock:
            live = [v for expiry, v in self._replicas.values() if expiry > now]
        return [st.ReplicaRecord.FromString(v) for v in live]

    # -- acceptance statistics -------------------------------------------------------------
    def add_acceptance(self, pair: str, tag: str, counts: AcceptanceCounts) -> str:
        """Add a request's rounds; returns the tag they were counted under."""
        with self._lock:
            if ((pair, tag) not in self._acceptance
                    and len(self._acceptance) >= contract.MAX_ACCEPTANCE_ENTRIES):
                tag = ""
            total = self._acceptance.setdefault((pair, tag), AcceptanceCounts([], []))
            total.merge(counts)
        return tag

    def acceptance(self, pair: str, tag: str) -> AcceptanceCounts:
        with self._lock:
            counts = self._acceptance.get((pair, tag), AcceptanceCounts([], []))
            return counts.copy()

    def acceptance_all(self) -> dict[tuple[str, str], AcceptanceCounts]:
        with self._lock:
            return {k: v.copy() for k, v in self._acceptance.items()}

    # -- API keys and rate limits ----------------------------------------------------------
    def put_api_key(self, key_hash: str, record: st.ApiKeyRecord) -> None:
        with self._lock:
            self._keys[key_hash] = record.SerializeToString()

    def api_key(self, key_hash: str) -> st.ApiKeyRecord | None:
        with self._lock:
            raw = self._keys.get(key_hash)
        return None if raw is None else st.ApiKeyRecord.FromString(raw)

    def take_request(self, key_hash: str, record: st.ApiKeyRecord) -> float:
        """Count one request against the key's limit: 0 if allowed, else seconds to wait."""
        if not record.requests_per_minute:
            return 0.0
        interval, tolerance = rate_limit_interval_ms(record)
        now = time.monotonic() * 1000
        with self._lock:
            tat = max(self._rate_tat.get(key_hash, now), now)
            if now < tat - tolerance:
                return (tat - tolerance - now) / 1000
            self._rate_tat[key_hash] = tat + interval
        return 0.0

    # -- journal -----------------------------------------------------------------------------
    def journal_start(self, request_id: str, record: st.JournalRecord, ttl_s: float,
                      lease_s: float) -> st.JournalRecord | None:
        """Open a journal; if one exists already, leave it and return its record. Only
        this router uses this store, and it runs every journal it holds: no leases."""
        now = time.monotonic()
        with self._lock:
            self._sweep_journal(now)
            existing = self._journal.get(request_id)
            if existing is not None and existing[0] > now:
                return st.JournalRecord.FromString(existing[1])
            self._journal[request_id] = (now + ttl_s, record.SerializeToString(), [])
        return None

    def journal_resume(self, request_id: str, lease_s: float) -> Resumable | None:
        """A journal lives only as long as this router, which runs every journal it holds:
        one found is running here or finished, never another's to take over."""
        found = self.journal(request_id)
        return None if found is None else Resumable(found[0], [], is_claimed=False)

    def journal_renew(self, request_ids: list[str], lease_s: float) -> None:
        """Nothing to renew: this store's journals live and die with this router."""

    def _sweep_journal(self, now: float) -> None:
        """Forget expired journals (Redis does this by TTL), so a router without Redis
        does not grow with every request it served. Oldest first, stopping at the first
        one still alive: entries are in start order and share one TTL."""
        while self._journal:
            request_id, (expiry, _, _) = next(iter(self._journal.items()))
            if expiry > now:
                return
            del self._journal[request_id]

    def journal_append(self, request_id: str, token_ids: list[int], ttl_s: float) -> None:
        with self._lock:
            if request_id not in self._journal:
                return
            _, raw, tokens = self._journal[request_id]
            tokens.extend(token_ids)
            self._journal[request_id] = (time.monotonic() + ttl_s, raw, tokens)

    def journal_finish(self, request_id: str, record: st.JournalRecord, ttl_s: float) -> None:
        with self._lock:
            _, _, tokens = self._journal.get(request_id, (0, b"", []))
            self._journal[request_id] = (time.monotonic() + ttl_s, record.SerializeToString(),
                                         tokens)

    def journal_drop(self, request_id: str) -> None:
        with self._lock:
            self._journal.pop(request_id, None)

    def journal(self, request_id: str) -> tuple[st.JournalRecord, list[int]] | None:
        with self._lock:
            entry = self._journal.get(request_id)
        if entry is None or entry[0] <= time.monotonic():
            return None
        return st.JournalRecord.FromString(entry[1]), list(entry[2])

