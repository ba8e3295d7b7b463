"""The store several routers and draft replicas share, in Redis (keys: keys.py)."""

from __future__ import annotations

import math
import threading
import time
import uuid

import numpy as np

from outrider.core.stats import AcceptanceCounts
from outrider.state import contract, keys
from outrider.state.contract import Resumable, StoreUnavailable, rate_limit_interval_ms
from outrider.v1 import state_pb2 as st

# GCRA in one atomic step, on Redis's clock so that every router agrees.
# KEYS[1] rate key; ARGV[1] interval ms, ARGV[2] burst tolerance ms -> 0 or ms to wait
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local allow_at = tat - tonumber(ARGV[2])
if now < allow_at then return tostring(allow_at - now) end
local new_tat = tat + tonumber(ARGV[1])
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now) + 1000)
return '0'
"""

# KEYS: the set of statistics names; ARGV: key prefix, pair, tag, most entries, then
# tested and accepted counts per position -> the name counted under
_ADD_ACCEPTANCE = """
local name = ARGV[2] .. ':' .. ARGV[3]
if redis.call('SISMEMBER', KEYS[1], name) == 0
    and redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  name = ARGV[2] .. ':'
end
redis.call('SADD', KEYS[1], name)
for j = 0, (#ARGV - 4) / 2 - 1 do
  redis.call('HINCRBY', ARGV[1] .. name, 't' .. j, ARGV[5 + 2 * j])
  redis.call('HINCRBY', ARGV[1] .. name, 'a' .. j, ARGV[6 + 2 * j])
end
return name
"""

# A journal is claimed while a router runs its request: KEYS[3] holds that router's
# claim with a short lease, or FINISHED_CLAIM once the response is recorded. No claim
# means nobody runs it (new, or its router died): this caller (re)starts it.
# KEYS: record, tokens, claim; ARGV: record, ttl ms, lease ms, owner -> nil or old record
_CLAIM_JOURNAL = """
if redis.call('SET', KEYS[3], ARGV[4], 'NX', 'PX', ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('DEL', KEYS[2])
  return false
end
return redis.call('GET', KEYS[1])
"""
FINISHED_CLAIM = "finished"

# A router resuming a request whose router failed takes over its journal, tokens kept,
# once the failed router's claim has lapsed.
# KEYS: record, tokens, claim; ARGV: lease ms, owner -> {} (no journal), {record} (claimed
# elsewhere, or finished), {record, tokens, 1} (now the caller's)
_RESUME_JOURNAL = """
local record = redis.call('GET', KEYS[1])
if not record then return {} end
if not redis.call('SET', KEYS[3], ARGV[2], 'NX', 'PX', ARGV[1]) then return {record} end
return {record, redis.call('GET', KEYS[2]) or '', 1}
"""

# KEYS: claims; ARGV: owner, lease ms. Only the owner's own running claims are extended.
_RENEW_CLAIMS = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('PEXPIRE', key, ARGV[2]) end
end
return 0
"""


class RedisStore:
    """The store several routers share, in Redis."""

    def __init__(self, url: str, timeout_s: float = 1.0, open_s: float = 2.0) -> None:
        import redis

        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self._gcra = self._redis.register_script(_GCRA)
        self._add_acceptance = self._redis.register_script(_ADD_ACCEPTANCE)
        self._claim = self._redis.register_script(_CLAIM_JOURNAL)
        self._renew = self._redis.register_script(_RENEW_CLAIMS)
        self._resume = self._redis.register_script(_RESUME_JOURNAL)
        self._owner = f"running:{uuid.uuid4().hex}"  # this router's claims
        # circuit breaker: after a failure, calls fail at once for open_s, then one call
        # at a time tries Redis again (a Redis that hangs must not stall every stream)
        self.open_s = open_s
        self._open_until = 0.0
        self._probe = threading.Lock()

    def script(self, lua: str):
        """A Lua script to run through `call` (as fn's `client=r`)."""
        return self._redis.register_script(lua)

    def call(self, fn):
        """fn(redis client), behind the circuit breaker; raises StoreUnavailable."""
        if time.monotonic() < self._open_until:
            raise StoreUnavailable("redis: unavailable (retrying shortly)")
        is_probe = self._open_until > 0
        if is_probe and not self._probe.acquire(blocking=False):
            raise StoreUnavailable("redis: unavailable (being probed)")
        try:
            result = fn(self._redis)
            self._open_until = 0.0
            return result
        except self._errors as exc:
            self._open_until = time.monotonic() + self.open_s
            raise StoreUnavailable(f"redis: {exc}") from exc
        finally:
            if is_probe:
                self._probe.release()

    # -- replica registry ------------------------------------------------------------------
    def put_replica(self, record: st.ReplicaRecord, ttl_s: float) -> None:
        def put(r):
            pipe = r.pipeline()
            pipe.set(keys.replica(record.address), record.SerializeToString(),
                     px=math.ceil(ttl_s * 1000))
            pipe.sadd(keys.REPLICAS, record.address)
            pipe.execute()
        self.call(put)

    def replicas(self) -> list[st.ReplicaRecord]:
        def read(r):
            addresses = sorted(a.decode() for a in r.smembers(keys.REPLICAS))
            values = r.mget([keys.replica(a) for a in addresses]) if addresses else []
            gone = [a for a, v in zip(addresses, values) if v is None]
            if gone:
                r.srem(keys.REPLICAS, *gone)
            return [st.ReplicaRecord.FromString(v) for v in values if v is not None]
        return self.call(read)

    # -- acceptance statistics -------------------------------------------------------------
    def add_acceptance(self, pair: str, tag: str, counts: AcceptanceCounts) -> str:
        """Add a request's rounds; returns the tag they were counted under."""
        per_position = [n for t, a in zip(counts.tested, counts.accepted) for n in (t, a)]
        name = self.call(lambda r: self._add_acceptance(
            keys=[keys.ACCEPTANCE_NAMES],
            args=[keys.ACCEPTANCE, pair, tag, contract.MAX_ACCEPTANCE_ENTRIES, *per_position],
            client=r))
        return name.decode().rpartition(":")[2]

    def acceptance(self, pair: str, tag: str) -> AcceptanceCounts:
        fields = self.call(lambda r: r.hgetall(keys.acceptance(pair, tag)))
        return _counts_from_fields(fields)

    def acceptance_all(self) -> dict[tuple[str, str], AcceptanceCounts]:
        names = self.call(lambda r: r.smembers(keys.ACCEPTANCE_NAMES))
        out = {}
        for name in sorted(n.decode() for n in names):
            pair, _, tag = name.rpartition(":")
            out[(pair, tag)] = self.acceptance(pair, tag)
        return out

    # -- API keys and rate limits ----------------------------------------------------------
    def put_api_key(self, key_hash: str, record: st.ApiKeyRecord) -> None:
        self.call(lambda r: r.set(keys.api_key(key_hash), record.SerializeToString()))

    def api_key(self, key_hash: str) -> st.ApiKeyRecord | None:
        raw = self.call(lambda r: r.get(keys.api_key(key_hash)))
        return None if raw is None else st.ApiKeyRecord.FromString(raw)

    def take_request(self, key_hash: str, record: st.ApiKeyRecord) -> float:
        if not record.requests_per_minute:
            return 0.0
        interval, tolerance = rate_limit_interval_ms(record)
        wait_ms = self.call(lambda r: self._gcra(keys=[keys.rate(key_hash)],
                                                  args=[interval, tolerance], client=r))
        return float(wait_ms) / 1000

    # -- journal -----------------------------------------------------------------------------
    def journal_start(self, request_id: str, record: st.JournalRecord, ttl_s: float,
                      lease_s: float) -> st.JournalRecord | None:
        """Open a journal and claim it for `lease_s` (renewed by `journal_renew` while
        this router runs it); if it is claimed already, leave it and return its record.
        A journal whose router stopped renewing is unclaimed, and starts over."""
        raw = self.call(lambda r: self._claim(
            keys=list(keys.journal(request_id)),
            args=[record.SerializeToString(), math.ceil(ttl_s * 1000),
                  math.ceil(lease_s * 1000), self._owner], client=r))
        return None if raw is None else st.JournalRecord.FromString(raw)

    def journal_resume(self, request_id: str, lease_s: float) -> Resumable | None:
        """The journal of a request being resumed, claimed for this router if its own
        router's claim has lapsed (its tokens kept); None when there is none."""
        found = self.call(lambda r: self._resume(
            keys=list(keys.journal(request_id)),
            args=[math.ceil(lease_s * 1000), self._owner], client=r))
        if not found:
            return None
        record = st.JournalRecord.FromString(found[0])
        if len(found) == 1:  # not the caller's to run: its tokens are not its business
            return Resumable(record, [], is_claimed=False)
        return Resumable(record, np.frombuffer(found[1], dtype="<i4").tolist(), True)

    def journal_renew(self, request_ids: list[str], lease_s: float) -> None:
        """Extend this router's claims on the journals of the requests it runs."""
        if request_ids:
            self.call(lambda r: self._renew(
                keys=[keys.journal(i)[2] for i in request_ids],
                args=[self._owner, math.ceil(lease_s * 1000)], client=r))

    def journal_append(self, request_id: str, token_ids: list[int], ttl_s: float) -> None:
        (record_key, tokens_key, _), ttl_ms = keys.journal(request_id), math.ceil(ttl_s * 1000)

        def append(r):
            pipe = r.pipeline()
            pipe.append(tokens_key, np.asarray(token_ids, dtype="<i4").tobytes())
            pipe.pexpire(tokens_key, ttl_ms)
            pipe.pexpire(record_key, ttl_ms)
            pipe.execute()
        self.call(append)

    def journal_finish(self, request_id: str, record: st.JournalRecord, ttl_s: float) -> None:
        (record_key, tokens_key, claim_key), ttl_ms = (keys.journal(request_id),
                                                       math.ceil(ttl_s * 1000))

        def finish(r):
            pipe = r.pipeline()
            pipe.set(record_key, record.SerializeToString(), px=ttl_ms)
            pipe.pexpire(tokens_key, ttl_ms)
            pipe.set(claim_key, FINISHED_CLAIM, px=ttl_ms)  # a retry gets the response
            pipe.execute()
        self.call(finish)

    def journal_drop(self, request_id: str) -> None:
        self.call(lambda r: r.delete(*keys.journal(request_id)))

    def journal(self, request_id: str) -> tuple[st.JournalRecord, list[int]] | None:
        record_key, tokens_key, _ = keys.journal(request_id)
        raw, out = self.call(lambda r: r.mget([record_key, tokens_key]))
        if raw is None:
            return None
        tokens = np.frombuffer(out or b"", dtype="<i4").tolist()
        return st.JournalRecord.FromString(raw), tokens


def _counts_from_fields(fields: dict[bytes, bytes]) -> AcceptanceCounts:
    n = 1 + max((int(k[1:]) for k in fields), default=-1)
    tested = [int(fields.get(f"t{j}".encode(), 0)) for j in range(n)]
    accepted = [int(fields.get(f"a{j}".encode(), 0)) for j in range(n)]
    return AcceptanceCounts(tested, accepted)
