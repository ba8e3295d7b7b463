"""The target replicas a router can use, and the choice among them.

A heartbeat loop asks every known replica for its Load (GetLoad) and writes what it
hears into the shared registry with a TTL, so routers sharing a store see the same
replicas, whichever of them was told about a replica. Known = this router's configured
addresses plus the registry's. When the store is away the loop keeps polling the
replicas it last knew (the snapshot) and the router keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from outrider.router.state import StoreUnavailable
from outrider.router.target_link import TargetLink

from outrider.cluster_tls import internal_channel
from outrider.core.policy import (
    MAX_QUEUED_PER_REPLICA,
    Acceptance,
    CostModel,
    GammaPolicy,
    PolicyConfig,
)
from outrider.grpc_server import token_metadata
from outrider.v1 import state_pb2 as st
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc


class ReplicaSet:
    def __init__(self, store, addresses: list[str], token: str | None,
                 heartbeat_s: float = 0.5, ttl_s: float = 3.0) -> None:
        self.store = store
        self.static_addresses = list(addresses)
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.metadata = token_metadata(token)
        self.on_live: Callable[[bool], None] | None = None  # after each heartbeat: any live?
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
                    ("grpc.max_receive_message_length", 64 * 2**20)])
            return worker_pb2_grpc.TargetStub(self._channels[address])

    def link(self, address: str) -> TargetLink:
        """The one stream this router runs its requests on `address` through."""
        stub = self.stub(address)
        with self._lock:
            if address not in self._links:
                self._links[address] = TargetLink(stub, self.metadata)
            return self._links[address]

    def live(self) -> list[st.ReplicaRecord]:
        with self._lock:
            return list(self._live.values())

    def mark_down(self, address: str) -> None:
        """A call to it failed: not a candidate until it answers a heartbeat again."""
        with self._lock:
            self._live.pop(address, None)

    # -- heartbeats --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.poll()

    def poll(self) -> None:
        self._discover()
        with self._lock:
            addresses = sorted(self._known)
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
        if self.on_live is not None:
            self.on_live(bool(live))
        with self._lock:
            self._live = live
            # addresses that stopped answering are forgotten once the registry drops them
            self._known = set(self.static_addresses) | set(live) | self._registered
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
    def pick(self, acceptance: Acceptance, avoid: set[str] = frozenset(),
             max_waiting: int = MAX_QUEUED_PER_REPLICA) -> st.ReplicaRecord | None:
        """The replica where this request should get the most tokens per second by the
        γ policy's estimate, preferring those not in `avoid` (a replica that failed this
        request may serve it again once it answers heartbeats); None when none is live
        or every queue is full."""
        candidates = [r for r in self.live() if r.load.num_waiting < max_waiting]
        fresh = [r for r in candidates if r.address not in avoid]
        if not (fresh or candidates):
            return None
        return max(fresh or candidates, key=lambda r: expected_rate(r.load, acceptance))


def expected_rate(load: pb.Load, acceptance: Acceptance) -> float:
    c = load.cost
    if not c.verify_base_s:  # no cost model reported: prefer the coolest replica
        return -load.heat
    cost = CostModel(c.verify_base_s, c.verify_per_token_s, c.draft_per_position_s,
                     c.draft_rtt_s, c.knee_tokens, c.draft_per_token_s)
    policy = GammaPolicy(PolicyConfig(gamma_max=load.gamma_max), cost)
    return policy.request_rate(load.heat, load.num_running + load.num_waiting, acceptance)
