"""The shared store behaves the same in Redis (a real redis-server) and in process."""

from __future__ import annotations

import time
import uuid

import pytest

from outrider.core.stats import AcceptanceCounts
from outrider.state import MemoryStore, RedisStore, StoreUnavailable
from outrider.v1 import state_pb2 as st
from outrider.v1 import worker_pb2 as pb


@pytest.fixture(params=["memory", "redis"])
def store(request, redis_url):
    if request.param == "memory":
        return MemoryStore()
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    return RedisStore(redis_url)


def test_replicas_expire_without_heartbeats(store):
    store.put_replica(st.ReplicaRecord(address="a:1", load=pb.Load(heat=0.5)), ttl_s=0.3)
    store.put_replica(st.ReplicaRecord(address="b:2"), ttl_s=30)
    assert sorted(r.address for r in store.replicas()) == ["a:1", "b:2"]
    assert next(r for r in store.replicas() if r.address == "a:1").load.heat == 0.5
    time.sleep(0.4)
    assert [r.address for r in store.replicas()] == ["b:2"]


def test_acceptance_counts_add_up_per_pair_and_tag(store):
    store.add_acceptance("t+d", "code", AcceptanceCounts([4, 3], [3, 1]))
    store.add_acceptance("t+d", "code", AcceptanceCounts([2, 1, 1], [1, 1, 0]))
    store.add_acceptance("t+d", "chat", AcceptanceCounts([1], [0]))
    assert store.acceptance("t+d", "code") == AcceptanceCounts([6, 4, 1], [4, 2, 0])
    assert store.acceptance("t+d", "none") == AcceptanceCounts([], [])
    assert set(store.acceptance_all()) == {("t+d", "code"), ("t+d", "chat")}


def test_tags_beyond_the_limit_share_the_untagged_statistics(store, monkeypatch):
    """A client may send a new tag with every request: the statistics stop growing at
    MAX_ACCEPTANCE_ENTRIES, and rounds under tags beyond it count for their pair."""
    monkeypatch.setattr("outrider.state.contract.MAX_ACCEPTANCE_ENTRIES", 3)
    counts = AcceptanceCounts([2, 1], [1, 0])
    assert [store.add_acceptance("t+d", tag, counts) for tag in ("a", "b", "c")] == ["a", "b", "c"]
    assert store.add_acceptance("t+d", "new", counts) == ""   # full: the pair's own
    assert store.add_acceptance("t+d", "b", counts) == "b"    # known tags still count
    assert store.add_acceptance("t+d", "other", counts) == ""
    stats = store.acceptance_all()
    assert sorted(stats) == [("t+d", ""), ("t+d", "a"), ("t+d", "b"), ("t+d", "c")]
    assert stats[("t+d", "")].tested == [4, 2] and stats[("t+d", "b")].accepted == [2, 0]


def test_acceptance_counts_follow_the_rounds():
    counts = AcceptanceCounts([], [])
    counts.add_round(gamma=4, num_accepted=1)  # position 0 accepted, 1 rejected, 2-3 untested
    counts.add_round(gamma=2, num_accepted=2)
    assert counts == AcceptanceCounts([2, 2], [2, 1])
    assert counts.alphas(prior=0.5, prior_weight=0)[1] == 0.5


def test_rate_limit_allows_a_burst_then_spaces_requests(store):
    record = st.ApiKeyRecord(name="k", requests_per_minute=600, burst=3)  # one per 0.1 s
    waits = [store.take_request("h", record) for _ in range(4)]
    assert waits[:3] == [0, 0, 0] and 0 < waits[3] <= 0.1 + 1e-3
    time.sleep(waits[3] + 0.01)
    assert store.take_request("h", record) == 0
    assert store.take_request("other", record) == 0  # limits are per key
    assert store.take_request("h", st.ApiKeyRecord(name="free")) == 0


def test_journal_keeps_tokens_and_refuses_a_second_start(store):
    rid = uuid.uuid4().hex
    record = st.JournalRecord(fingerprint="f", prompt_ids=[1, 2])
    assert store.journal_start(rid, record, ttl_s=30, lease_s=30) is None
    store.journal_append(rid, [5, 6], ttl_s=30)
    store.journal_append(rid, [7], ttl_s=30)
    assert store.journal_start(rid, record, ttl_s=30, lease_s=30).fingerprint == "f"
    got, tokens = store.journal(rid)
    assert (list(got.prompt_ids), tokens, got.is_finished) == ([1, 2], [5, 6, 7], False)
    store.journal_finish(rid, st.JournalRecord(fingerprint="f", is_finished=True), ttl_s=30)
    assert store.journal(rid)[0].is_finished and store.journal(rid)[1] == [5, 6, 7]
    store.journal_drop(rid)
    assert store.journal(rid) is None


# a claim's lease here: longer than any gap between two calls of a test on a loaded
# machine (a 0.5 s lease once lapsed between two consecutive calls inside the suite)
LEASE_S = 2.0


def test_a_journal_nobody_renews_is_free_again_once_its_lease_lapses(redis_url):
    """Two routers share Redis; the one running a request dies (stops renewing). Until
    its lease lapses a retry is refused; after it, the retry claims the id afresh."""
    alive, crashed = RedisStore(redis_url), RedisStore(redis_url)
    rid, record = uuid.uuid4().hex, st.JournalRecord(fingerprint="f", prompt_ids=[1])
    assert crashed.journal_start(rid, record, ttl_s=30, lease_s=LEASE_S) is None
    crashed.journal_append(rid, [5, 6], ttl_s=30)
    alive.journal_renew([rid], lease_s=30)  # not its claim: must not extend it
    assert alive.journal_start(rid, record, ttl_s=30, lease_s=5).fingerprint == "f"
    time.sleep(LEASE_S + 0.2)
    assert alive.journal_start(rid, record, ttl_s=30, lease_s=5) is None  # taken over
    assert alive.journal(rid)[1] == []  # it starts over: the dead router's tokens are gone
    assert crashed.journal_start(rid, record, ttl_s=30, lease_s=5) is not None  # now held


def test_renewal_keeps_a_claim_and_never_shortens_a_finished_one(redis_url):
    router, other = RedisStore(redis_url), RedisStore(redis_url)
    rid, record = uuid.uuid4().hex, st.JournalRecord(fingerprint="f")
    assert router.journal_start(rid, record, ttl_s=30, lease_s=LEASE_S) is None
    for _ in range(4):  # renewed past the first lease's end
        time.sleep(LEASE_S * 0.3)
        router.journal_renew([rid], lease_s=LEASE_S)
    assert other.journal_start(rid, record, ttl_s=30, lease_s=5) is not None  # still held
    router.journal_finish(rid, st.JournalRecord(fingerprint="f", is_finished=True), ttl_s=30)
    router.journal_renew([rid], lease_s=0.1)  # a renewal racing the finish
    time.sleep(0.3)
    assert other.journal_start(rid, record, ttl_s=30, lease_s=5).is_finished  # replayed


def test_api_keys_are_records_under_their_hash(store):
    store.put_api_key("abc", st.ApiKeyRecord(name="team", tags=["code"]))
    assert store.api_key("abc").name == "team" and store.api_key("nope") is None


def test_an_unreachable_redis_is_reported_as_such():
    from outrider.launch import free_port

    dead = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    with pytest.raises(StoreUnavailable):
        dead.replicas()
