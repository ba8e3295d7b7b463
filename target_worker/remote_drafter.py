"""The target's side of Propose: the Proposer contract served by draft replicas over gRPC.

Sequences stick to one replica (hash of the id over the healthy replicas). One Propose
per replica per round, all in flight at once. A replica that fails or times out is set
aside for a while and its sequences run with γ = 0 this round; next round they move to
a healthy replica, which answers MISS, and the decoder resends their whole context.
"""

from __future__ import annotations

import threading
import time
import zlib

import grpc
import torch

from outrider.cluster_tls import QUICK_RECONNECT, internal_channel
from outrider.core.sampling import sampling_to_proto
from outrider.core.stats import DRAFT_MODEL_METHODS, MODEL_METHOD
from outrider.dense_channel import DenseChannel
from outrider.engine.features import FeatureTap
from outrider.engine.heads import RemoteHead
from outrider.engine.proposer import DraftItem, PendingProposal, Proposal
from outrider.engine.rejection import dense_draft_probs
from outrider.grpc_server import token_metadata
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import (
    Q_FORMAT_CODES,
    WireError,
    checked_ids,
    checked_q,
    decode_q,
    encode_features,
    q_format_for,
)

PREFILL_ALLOWANCE_S = 0.002  # per context token resent in a Propose
MAX_BACKOFF_S = 5.0           # longest wait before trying a slow or failing replica again
UNREACHABLE_RETRY_S = 0.5     # wait before trying an unreachable replica again


class DraftReplicaError(RuntimeError):
    """No draft replica could be reached or they disagree with the target."""


class RemoteDrafter:
    def takes_guesses(self, kind: str) -> bool:
        return False  # (a Proposer's: no lookahead)

    def __init__(self, addresses: list[str], token: str | None, seq_prefix: str,
                 timeout_s: float = 10.0, retry_after_s: float = 2.0,
                 dense_channel: DenseChannel | None = None,
                 head: RemoteHead | None = None, target_vocab: str = "") -> None:
        """target_vocab: this target's vocabulary (core.tokenizer.vocab_fingerprint), so that
        a replica drafting for targets of several proposes in its ids."""
        if not addresses:
            raise DraftReplicaError("no draft replica addresses given")
        self.addresses = addresses
        self.seq_prefix = seq_prefix  # keeps ids unique when targets share a draft replica
        self.target_vocab = target_vocab
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._metadata = token_metadata(token)
        self._channels = [_channel(a) for a in addresses]
        self._stubs = [worker_pb2_grpc.DraftStub(c) for c in self._channels]
        self._down_until = [0.0] * len(addresses)
        self._assigned: dict[object, int] = {}
        # address -> (draft weights' version, k of the target's top-k asked for), as it
        # said in its last reply
        self._reported: dict[str, tuple[int, int]] = {}
        self._next_addresses: list[str] | None = None  # set_addresses, applied by submit
        self._lock = threading.Lock()
        self._releases: list[grpc.Future] = []
        self.dense_channel = dense_channel  # to replica 0, when it is co-located
        self._dist_tag = 0
        self._backoff = [retry_after_s] * len(addresses)
        self._rpc_seconds: float | None = None  # EWMA of Propose round trips
        self.num_failures = 0
        stats = self._describe()
        self.vocab_size, self.max_model_len = stats.vocab_size, stats.max_model_len
        self.model_name = stats.model_name
        self.prepares_ahead = stats.speculation_cache  # (Proposer: ready_only items)
        # the head the replicas run (they say which): its features go with each Propose
        self.head = head
        self.method = stats.method or MODEL_METHOD
        if self.method not in ((head.method,) if head else DRAFT_MODEL_METHODS):
            raise DraftReplicaError(
                f"the draft replicas at {', '.join(addresses)} run a {self.method} "
                f"({self.model_name}), but this target "
                + (f"was given a {head.method} head" if head else "was given no head "
                   "(--draft-head DIR: the head they run, whose features it sends)"))
        if head and stats.feature_width != head.width:
            raise DraftReplicaError(f"the draft replicas' head reads features "
                                    f"{stats.feature_width} wide, this target's head "
                                    f"{head.width}: not the same head")

    def _describe(self) -> pb.DraftStats:
        for stub in self._stubs:
            try:
                return stub.Stats(pb.DraftStatsRequest(target_vocab=self.target_vocab),
                                  metadata=self._metadata, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # (not for this target)
                    raise DraftReplicaError(exc.details()) from None
                continue
        raise DraftReplicaError(f"no draft replica answers at {', '.join(self.addresses)}")

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def set_addresses(self, addresses: list[str]) -> None:
        """Speculate with these replicas from the next round on (called from any thread)."""
        if not addresses:
            raise DraftReplicaError("no draft replica addresses given")
        with self._lock:
            self._next_addresses = list(addresses)

    def _apply_addresses(self) -> None:
        """Between rounds, on the engine thread: sequences on a kept replica stay there;
        those on a removed one move (their new replica answers MISS and gets the context)."""
        with self._lock:
            new, self._next_addresses = self._next_addresses, None
        if new is None or new == self.addresses:
            return
        old = self.addresses
        channels = {a: c for a, c in zip(old, self._channels)}
        for address in set(old) - set(new):
            channels.pop(address).close()
        self._channels = [channels.get(a) or _channel(a) for a in new]
        self._stubs = [worker_pb2_grpc.DraftStub(c) for c in self._channels]
        self._down_until = [0.0] * len(new)
        self._backoff = [self.retry_after_s] * len(new)
        self._assigned = {seq: new.index(old[r]) for seq, r in self._assigned.items()
                          if old[r] in new}
        self._reported = {a: r for a, r in self._reported.items() if a in new}
        if self.dense_channel is not None and new[0] != old[0]:
            self.dense_channel = None  # it pairs with the first replica only: q goes by gRPC
        self.addresses = new

    # -- the Proposer contract ----------------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest draft weights' version a replica reported."""
        return max((v for v, _ in self._reported.values()), default=0)

    @property
    def target_topk(self) -> int:
        """k of the target's top-k some replica asked for (it adapts), else 0."""
        return max((k for _, k in self._reported.values()), default=0)

    @property
    def drafts_trees(self) -> bool:
        return False  # (Propose carries chains)

    @property
    def reads_target(self) -> FeatureTap | None:
        """A head's taps (their features go with Propose); a draft model reads tokens."""
        return self.head.tap if self.head else None

    def version_of(self, seq_id) -> int:
        """The version of the replica that drafts for `seq_id`."""
        replica = self._assigned.get(seq_id)
        return 0 if replica is None else self._reported.get(self.addresses[replica], (0, 0))[0]

    def release(self, seq_id) -> bool:
        """Fire-and-forget: the engine loop never waits on a Release; a dead replica holds
        nothing and a live one that misses it evicts the idle sequence later anyway."""
        replica = self._assigned.pop(seq_id, None)
        if replica is not None:
            # keep a reference: a collected call future cancels its RPC
            self._releases = [f for f in self._releases if not f.done()]
            self._releases.append(self._stubs[replica].Release.future(
                pb.ReleaseRequest(seq_ids=[self._wire_id(seq_id)]), metadata=self._metadata,
                timeout=self.timeout_s))
        return replica is not None

    def draft(self, items: list[DraftItem], device: torch.device) -> Proposal:
        return self.submit(items, device).result()

    def submit(self, items: list[DraftItem], device: torch.device,
               beside_target: bool = False) -> PendingProposal:
        """Send one Propose per replica now; the PendingProposal gathers the replies.
        `beside_target`: the target verifies meanwhile rather than waiting for it."""
        self._apply_addresses()
        groups: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            if it.is_active:
                groups.setdefault(self._replica_for(it.seq_id), []).append(i)
        formats = [self._q_format(it, self._assigned.get(it.seq_id, -1)) for it in items]
        features = self._features(items, [i for r, rows in groups.items() if r >= 0
                                          for i in rows])
        self._dist_tag += 1
        start = time.monotonic()
        calls = {r: self._stubs[r].Propose.future(
                     self._request(items, formats, features, rows, beside_target,
                                   self._reported.get(self.addresses[r], (0, 0))[1] > 0),
                     metadata=self._metadata,
                     timeout=self._deadline(sum(len(items[i].new_token_ids) for i in rows)))
                 for r, rows in groups.items() if r >= 0}
        return PendingProposal(lambda: self._gather(items, formats, groups, calls, start, device))

    def _gather(self, items, formats, groups, calls, start: float,
                device: torch.device) -> Proposal:
        gammas = [0] * len(items)
        # a prefill-only item is a miss unless a replica took it in (Proposal.is_miss): one
        # whose call failed, or that went nowhere, must not count as held
        is_miss = [it.prefill_only and it.is_active for it in items]
        ranks = [0] * len(items)
        prepared: list[dict] = [{} for _ in items]
        token_rows: list[list[int]] = [[] for _ in items]
        q_rows: dict[int, torch.Tensor] = {}
        for replica, call in calls.items():
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                self._set_aside(replica, is_unreachable=exc.code() == grpc.StatusCode.UNAVAILABLE)
                continue
            self._healthy(replica, time.monotonic() - start)
            self._reported[self.addresses[replica]] = (reply.draft_version, reply.target_topk)
            for i, proposal in zip(groups[replica], reply.proposals):
                is_miss[i], ranks[i] = proposal.miss, proposal.cache_rank
                prepared[i] = _prepared(proposal, self.vocab_size)
                self._read(items[i], proposal, formats[i], i, gammas, is_miss, token_rows, q_rows)
            self._receive_dense(groups[replica], reply, formats, gammas, token_rows, q_rows)
        out = _pack(items, gammas, is_miss, token_rows, q_rows, self.vocab_size, device)
        out.cache_ranks = ranks if any(ranks) else []
        out.prepared = prepared if any(prepared) else []
        return out

    def _deadline(self, num_new_tokens: int) -> float:
        """Generous against the usual round trip, so a hung (not dead) replica stalls the
        batch for a moment, not for the full timeout; a call that resends long contexts
        (after a MISS, to a freshly started replica) gets time for their prefill."""
        if self._rpc_seconds is None:
            return self.timeout_s
        prefill_s = PREFILL_ALLOWANCE_S * num_new_tokens
        return min(self.timeout_s, max(0.5, 20 * self._rpc_seconds) + prefill_s)

    def _healthy(self, replica: int, seconds: float) -> None:
        self._backoff[replica] = self.retry_after_s
        previous = self._rpc_seconds if self._rpc_seconds is not None else seconds
        self._rpc_seconds = 0.9 * previous + 0.1 * seconds

    def _q_format(self, item: DraftItem, replica: int) -> str:
        has_channel = replica == 0 and self.dense_channel is not None \
            and self.dense_channel.is_ready
        return q_format_for(item.params, has_channel)

    def _receive_dense(self, rows: list[int], reply: pb.ProposeResponse, formats: list[str],
                       gammas: list[int], token_rows: list[list[int]],
                       q_rows: dict[int, torch.Tensor]) -> None:
        """The replica sent the q rows of every drafted dense_dist sequence of this call,
        in request order, as one message; without them those drafts are not used."""
        sent = [(i, len(p.token_ids)) for i, p in zip(rows, reply.proposals)
                if formats[i] == "dense_dist" and not p.miss and p.token_ids]
        if not sent:
            return
        try:
            dense = self.dense_channel.recv(sum(n for _, n in sent), self.vocab_size,
                                            self._dist_tag)
        except RuntimeError:
            self.dense_channel.mark_broken()
            dense = None
        offset = 0
        for i, n in sent:
            q = None if dense is None else _checked_or_none(dense[offset:offset + n],
                                                             token_rows[i])
            offset += n
            if q is None or not gammas[i]:
                gammas[i] = 0  # drafts without a usable q are not verified
            else:
                q_rows[i] = q

    # -- helpers -----------------------------------------------------------------------------
    def _wire_id(self, seq_id) -> str:
        return f"{self.seq_prefix}{seq_id}"

    def _replica_for(self, seq_id) -> int:
        now = time.monotonic()
        current = self._assigned.get(seq_id)
        if current is not None and self._down_until[current] <= now:
            return current
        healthy = [r for r, t in enumerate(self._down_until) if t <= now]
        if not healthy:
            return -1
        replica = healthy[zlib.crc32(str(seq_id).encode()) % len(healthy)]
        self._assigned[seq_id] = replica
        return replica

    def _set_aside(self, replica: int, is_unreachable: bool) -> None:
        """Try the replica again soon when it was unreachable (such a call fails at once,
        so probing costs nothing and a restarted replica is found quickly); after a
        back-off that doubles when it was slow or failing (a hung replica must not
        stall every batch)."""
        self.num_failures += 1
        if replica == 0 and self.dense_channel is not None:
            self.dense_channel.mark_broken()  # a send may be left unmatched
        if is_unreachable:
            self._down_until[replica] = time.monotonic() + UNREACHABLE_RETRY_S
            return
        self._down_until[replica] = time.monotonic() + self._backoff[replica]
        self._backoff[replica] = min(MAX_BACKOFF_S, 2 * self._backoff[replica])

    @staticmethod
    def _features(items: list[DraftItem], sent: list[int]) -> dict[int, pb.Features]:
        """Item index -> its features on the wire (as the target kept them: fused)."""
        return {i: encode_features(items[i].features) for i in sent
                if items[i].features is not None}

    def _request(self, items: list[DraftItem], formats: list[str],
                 features: dict[int, pb.Features], rows: list[int],
                 beside_target: bool, teach: bool) -> pb.ProposeRequest:
        """`teach`: the replica adapts, it gets the target's top-k rows."""
        seqs = []
        for i in rows:
            it = items[i]
            teacher = [pb.TeacherRow(position=p, token_ids=ids, logprobs=lps)
                       for p, ids, lps in it.teacher] if teach else []
            seqs.append(pb.ProposeSequence(
                seq_id=self._wire_id(it.seq_id), committed_len=it.committed_len,
                new_token_ids=it.new_token_ids, gamma=it.gamma,
                sampling=sampling_to_proto(it.params, it.seed),
                q_format=Q_FORMAT_CODES[formats[i]], traceparent=it.traceparent,
                prefill_only=it.prefill_only, prompt_len=it.prompt_len, teacher=teacher,
                features=features.get(i), ready_only=it.ready_only,
                unprepared=not it.prepare, deliver=it.deliver))
        return pb.ProposeRequest(sequences=seqs, dist_tag=self._dist_tag,
                                 beside_target=beside_target, target_vocab=self.target_vocab)

    def _read(self, item: DraftItem, proposal: pb.Proposal, q_format: str, i: int, gammas,
              is_miss, token_rows, q_rows) -> None:
        if proposal.miss:
            is_miss[i] = True
            return
        gamma = len(proposal.token_ids)
        if gamma > item.gamma:
            return  # not what was asked: unused, γ = 0 this round
        try:  # point masses need nothing but their ids; dense_dist q comes by the channel
            if q_format in ("ids", "point_mass"):
                checked_ids(proposal, self.vocab_size)
            elif q_format != "dense_dist":
                q_rows[i] = decode_q(proposal, q_format, self.vocab_size)
        except WireError:
            return  # a malformed proposal is simply not used: γ = 0 this round
        gammas[i], token_rows[i] = gamma, list(proposal.token_ids)


def _prepared(proposal: pb.Proposal, vocab: int) -> dict[tuple[int, ...], tuple[list[int], int]]:
    """A delivery's outcomes (Proposal.prepared); one with an id outside the vocabulary
    is not used (it could never be verified)."""
    return {tuple(p.outcome): (list(p.token_ids), p.rank) for p in proposal.prepared
            if all(0 <= t < vocab for t in (*p.outcome, *p.token_ids))}


def _checked_or_none(q: torch.Tensor, token_ids: list[int]) -> torch.Tensor | None:
    try:
        return checked_q(q, torch.tensor(token_ids), "dense channel")
    except WireError:
        return None


def _pack(items, gammas, is_miss, token_rows, q_rows, vocab: int,
          device: torch.device) -> Proposal:
    """Dense q only when some row brought one; point-mass rows are their ids."""
    max_gamma = max(gammas, default=0)
    token_ids = torch.tensor([row + [0] * (max_gamma - len(row)) if g else [0] * max_gamma
                              for row, g in zip(token_rows, gammas)],
                             dtype=torch.long).view(len(items), max_gamma)
    probs = None
    if any(gammas[i] for i in q_rows):
        probs = dense_draft_probs(token_ids, vocab)
        for i, q in q_rows.items():
            if gammas[i]:
                probs[i, :gammas[i]] = q
        probs = probs.to(device)
    return Proposal(token_ids.to(device), probs, gammas, is_miss)


def _channel(address: str) -> grpc.Channel:
    return internal_channel(address, options=QUICK_RECONNECT)
