"""The target replicas a router can use, and the choice among them.

A heartbeat loop asks every known replica for its Load (GetLoad) and writes what it
hears into the shared registry with a TTL, so routers sharing a store see the same
replicas, whichever of them was told about a replica. Known = this router's configured
addresses plus the registry's. When the store is away the loop keeps polling the
replicas it last knew (the snapshot) and the router keeps serving."""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import grpc
from outrider.router.prefix_index import PrefixIndex, block_chain
from outrider.router.target_link import TargetLink

from outrider.cluster_tls import QUICK_RECONNECT, internal_channel
from outrider.core.policy import (
    MAX_QUEUED_PER_REPLICA,
    Acceptance,
    CostModel,
    GammaPolicy,
    PolicyConfig,
)
from outrider.grpc_server import token_metadata
from outrider.state import StoreUnavailable
from outrider.v1 import state_pb2 as st
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

ROUTING = ("cache-aware", "round-robin")


class ReplicaSet:
    def __init__(self, store, addresses: list[str], token: str | None,
                 heartbeat_s: float = 0.5, ttl_s: float = 3.0,
                 routing: str = "cache-aware") -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}, got {routing!r}")
        self.store = store
        self.routing = routing
        self.prefixes = PrefixIndex()
        # per replica, the uncached prompt tokens of requests this router sent it that
        # have no token yet (request id -> tokens)
        self._prefilling: defaultdict[str, dict[str, int]] = defaultdict(dict)
        self._turn = itertools.count()  # round-robin
        # this router's (requests, prefilling tokens) there when it last reported
        self._own_at_report: dict[str, tuple[int, int]] = {}
        self.static_addresses = list(addresses)
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.metadata = token_metadata(token)
        self.on_live: Callable[[], None] | None = None  # after each heartbeat (live() new)
        self.is_store_reachable = True
        self._live: dict[str, st.ReplicaRecord] = {}   # answered the last heartbeat
        self._known: set[str] = set(addresses)
        self._registered: set[str] = set()   # addresses in the shared registry
        self._channels: dict[str, grpc.Channel] = {}
        self._links: dict[str, TargetLink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-heartbeat",
                                        daemon=True)

    def start(self) -> None:
        self.poll()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for link in self._links.values():
            link.close()
        for channel in self._channels.values():
            channel.close()

    def stub(self, address: str) -> worker_pb2_grpc.TargetStub:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = internal_channel(address, options=[
                    ("grpc.max_receive_message_length", 64 * 2**20), *QUICK_RECONNECT])
            return worker_pb2_grpc.TargetStub(self._channels[address])

    def link(self, address: str) -> TargetLink:
        """The one stream this router runs its requests on `address` through."""
        stub = self.stub(address)
        with self._lock:
            if address not in self._links:
                self._links[address] = TargetLink(stub, self.metadata)
            return self._links[address]

    def live(self, serves: Callable[[pb.Load], bool] | None = None) -> list[st.ReplicaRecord]:
        """The replicas that answered the last heartbeat (those `serves` accepts)."""
        with self._lock:
            records = list(self._live.values())
        return [r for r in records if serves(r.load)] if serves else records

    def mark_down(self, address: str) -> None:
        """A call to it failed: not a candidate until it answers a heartbeat again, and
        its cache is taken for lost (it may have restarted)."""
        with self._lock:
            self._live.pop(address, None)
        self.prefixes.forget(address)

    # -- heartbeats --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.poll()

    def poll(self) -> None:
        self._discover()
        with self._lock:
            addresses = sorted(self._known)
            own = {a: (self._links[a].num_running if a in self._links else 0,
                       sum(self._prefilling[a].values())) for a in addresses}
        calls = {a: self.stub(a).GetLoad.future(pb.LoadRequest(), metadata=self.metadata,
                                                timeout=max(1.0, 2 * self.heartbeat_s))
                 for a in addresses}
        live = {}
        for address, call in calls.items():
            try:
                load = call.result()
            except grpc.RpcError:
                continue
            live[address] = st.ReplicaRecord(address=address, load=load,
                                             heartbeat_unix_s=time.time())
        with self._lock:
            self._live = live
            self._own_at_report = own
            # addresses that stopped answering are forgotten once the registry drops them
            self._known = set(self.static_addresses) | set(live) | self._registered
        if self.on_live is not None:
            self.on_live()
        self._publish(live.values())

    def _discover(self) -> None:
        try:
            self._registered = {r.address for r in self.store.replicas()}
            self.is_store_reachable = True
        except StoreUnavailable:
            self.is_store_reachable = False  # keep the snapshot: the known addresses
            return
        with self._lock:
            self._known |= self._registered

    def _publish(self, records) -> None:
        try:
            for record in records:
                self.store.put_replica(record, self.ttl_s)
        except StoreUnavailable:
            self.is_store_reachable = False

    # -- choice ------------------------------------------------------------------------------
    def pick(self, acceptance_of: Callable[[str], Acceptance], avoid: set[str] = frozenset(),
             max_waiting: int = MAX_QUEUED_PER_REPLICA, prompt_ids: list[int] = (),
             max_tokens: int = 1, request_id: str = "",
             serves: Callable[[pb.Load], bool] | None = None) -> st.ReplicaRecord | None:
        """The replica expected to serve this request soonest (`expected_seconds`, at
        the request's acceptance with each replica's model pair, `acceptance_of(pair)`,
        and the cost of that pair's replicas: where replicas of one target speculate with
        different drafts, the choice of replica is the choice of draft), or the next in
        turn under round-robin; those not in `avoid` first (a replica that
        failed this request may serve it again once it answers heartbeats). None when
        none is live or every queue is full. The choice is remembered: the request's
        prompt is in that replica's cache from now on, and its prefill is queued there
        until `prefilled(address, request_id)`. `serves`: the replicas of the request's
        model (router/models.py)."""
        candidates = [r for r in self.live(serves) if r.load.num_waiting < max_waiting]
        candidates = [r for r in candidates if r.address not in avoid] or candidates
        if not candidates:
            return None
        if self.routing == "round-robin":
            candidates.sort(key=lambda r: r.address)
            choice = candidates[next(self._turn) % len(candidates)]
        else:
            chains = _Chains(prompt_ids)  # each block size's chain, hashed once
            uncached = {r.address: len(prompt_ids) - self._cached_tokens(r, chains)
                        for r in candidates}
            by_pair = defaultdict(list)
            for r in candidates:
                by_pair[r.load.model_pair].append(r.load)
            cost = {pair: mean_cost(loads) for pair, loads in by_pair.items()}
            acceptance = {pair: acceptance_of(pair) for pair in by_pair}
            seconds = {r.address: expected_seconds(
                r.load, acceptance[r.load.model_pair], uncached[r.address], max_tokens,
                *self._now(r), cost[r.load.model_pair]) for r in candidates}
            choice = min(candidates, key=lambda r: (seconds[r.address], uncached[r.address]))
            with self._lock:
                self._prefilling[choice.address][request_id] = uncached[choice.address]
            self._note_prefix(choice, chains)
        return choice

    def prefilled(self, address: str, request_id: str) -> None:
        """The request's first token came (or it ended): its prefill is no longer queued."""
        with self._lock:
            self._prefilling[address].pop(request_id, None)

    def note_prefix(self, address: str, token_ids: list[int]) -> None:
        """The replica has computed (and, with prefix caching, keeps) these tokens' KV."""
        with self._lock:
            replica = self._live.get(address)
        if replica is not None:
            self._note_prefix(replica, _Chains(token_ids))

    def _note_prefix(self, replica: st.ReplicaRecord, chains: _Chains) -> None:
        if replica.load.prefix_caching and replica.load.block_size:
            self.prefixes.add(replica.address, chains.of(replica.load.block_size),
                              replica.load.kv_total_blocks)

    def _now(self, replica: st.ReplicaRecord) -> tuple[int, float]:
        """Its requests and queued tokens now: other routers' as it last reported (up to a
        heartbeat old), this router's own as they are now."""
        address, load = replica.address, replica.load
        with self._lock:
            link = self._links.get(address)
            running_then, prefilling_then = self._own_at_report.get(address, (0, 0))
            prefilling = sum(self._prefilling[address].values())
        running = max(0, load.num_running + load.num_waiting - running_then)
        queued = max(0, load.queued_tokens - prefilling_then)
        return running + (link.num_running if link else 0), queued + prefilling

    def _cached_tokens(self, replica: st.ReplicaRecord, chains: _Chains) -> int:
        """Prompt tokens the replica is expected to hold; never the last block holding
        the last token, which the replica always computes."""
        size = replica.load.block_size
        if not (replica.load.prefix_caching and size):
            return 0
        usable = (len(chains.token_ids) - 1) // size
        return size * min(usable, self.prefixes.num_cached_blocks(replica.address,
                                                                  chains.of(size)))


class _Chains:
    """A token list's block chains (router/prefix_index.py), one per block size, each
    hashed once however many replicas are weighed."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._by_size: dict[int, list[int]] = {}

    def of(self, size: int) -> list[int]:
        if size not in self._by_size:
            self._by_size[size] = block_chain(self.token_ids, size)
        return self._by_size[size]


def mean_cost(loads: list[pb.Load]) -> CostModel | None:
    """The cost models of replicas of one model pair averaged: the router compares them
    by their load and cache, not by the noise between their models (a replica refits its
    model only while it runs, so an idle one's looks cheaper). None: none reports one."""
    costs = [x.cost for x in loads if x.cost.verify_base_s]
    if not costs:
        return None
    mean = lambda name: sum(getattr(c, name) for c in costs) / len(costs)  # noqa: E731
    return CostModel(mean("verify_base_s"), mean("verify_per_token_s"),
                     mean("draft_per_position_s"), mean("draft_rtt_s"),
                     round(mean("knee_tokens")), mean("draft_per_token_s"),
                     mean("plain_offset_s"))


def expected_seconds(load: pb.Load, acceptance: Acceptance, num_uncached: int,
                     max_tokens: int, num_running: int, num_queued: float,
                     cost: CostModel | None = None) -> float:
    """What one more request like this costs on a replica, in seconds (docs/DESIGN.md §4.5):

        (queued + uncached · (running + 1)) · s_token  +  max_tokens / rate(running)

    - queued · s_token: waiting for the prompt tokens already queued there
      (ReplicaSet._now: other routers' share of its reported queued_tokens, and the
      uncached prompt tokens of this router's requests there that have no token yet);
    - uncached · (running + 1) · s_token: its own uncached prompt tokens, whose steps it
      and every one of the `running` requests beside it wait on — so a cached prefix is
      worth more on a busy replica;
    - max_tokens / rate: its decoding, at the γ policy's expected tokens/s for it beside
      `running` requests (the request's acceptance, the replica's cost model and γ_max).
    s_token is the cost of one more position in a forward, from `cost` (by default the
    replica's own measured model). Without a cost model the replica's heat counts instead
    (uncached tokens break ties)."""
    cost = cost or mean_cost([load])
    if cost is None:
        return load.heat + num_uncached * 1e-9
    policy = GammaPolicy(PolicyConfig(gamma_max=load.gamma_max), cost)
    rate = policy.request_rate(load.heat, num_running, acceptance)
    return ((num_queued + num_uncached * (num_running + 1)) * cost.verify_per_token_s
            + max_tokens / rate)
