"""The router's public gRPC service (protos/outrider/v1/generate.proto).

A request is authenticated, validated, journaled, and sent to the target replica where
the γ policy expects it to get the most tokens per second. Its tokens stream back
through incremental detokenisation and stop strings; the journal keeps every committed
token, so when a replica fails mid-stream the request continues on another one from
prompt + committed tokens, and the client's stream goes on with nothing lost or
repeated (docs/DESIGN.md §6).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc
from outrider.router.admission import Admission
from outrider.router.auth import Authenticator, AuthError
from outrider.router.claims import ClaimKeeper
from outrider.router.refusal import Refused
from outrider.router.replicas import ReplicaSet
from outrider.router.target_link import StreamUnread
from outrider.router.telemetry import RequestTelemetry, RouterTelemetry
from outrider.router.text_stream import TextStream
from outrider.router.validate import Job, ValidationError, client_tag, validate

from outrider.core.grammar import Grammars
from outrider.core.load import pair_has_draft
from outrider.core.policy import MAX_QUEUED_PER_REPLICA, Acceptance, SpecMode
from outrider.core.sampling import sampling_to_proto
from outrider.core.stats import PRIOR_ALPHA, SpecStats
from outrider.core.tokenizer import Tokenizer
from outrider.grpc_server import remaining_timeout
from outrider.state import MAX_ACCEPTANCE_ENTRIES, StoreUnavailable
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc
from outrider.v1 import state_pb2 as st
from outrider.v1 import worker_pb2 as pb

TARGET_MODES = {SpecMode.AUTO: pb.SPEC_MODE_AUTO, SpecMode.OFF: pb.SPEC_MODE_OFF,
                SpecMode.FIXED: pb.SPEC_MODE_FIXED}
# a replica that fails with these may be gone: the request moves to another one
MIGRATE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# requests a model pair with a draft may finish without a drafted round before the choice
# of replica stops believing PRIOR_ALPHA of it
UNTRIED_REQUESTS = 4


@dataclass(frozen=True)
class ServiceLimits:
    max_migrations: int = 2         # replica failures one request survives
    journal_ttl_s: float = 600.0
    journal_lease_s: float = 5.0    # a crashed router's request ids free up after this
    max_running: int = 256          # generations running at once (gRPC and HTTP together)
    max_queued: int = 64            # generations waiting for a slot; more: RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 10.0  # a queued request waits this long at most
    max_waiting: int = MAX_QUEUED_PER_REPLICA  # a replica with this many queued takes no more
    replica_wait_s: float = 10.0    # how long a request waits for a replica to appear
    prior_cache_s: float = 5.0      # shared acceptance statistics are re-read this often

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max running requests must be at least 1, got {self.max_running}")
        if self.max_queued < 0 or self.max_queue_wait_s < 0:
            raise ValueError("the queue's size and wait must not be negative")


@dataclass(frozen=True)
class Journal:
    """What a request's journal holds for it at admission."""

    replay: gp.GenerateResponse | None = None  # it finished: this answers it
    resumed: list[int] | None = None           # resumed: the tokens it goes on from


@dataclass
class Progress:
    """One request's state at the router across replicas."""

    job: Job
    text: TextStream
    output_ids: list[int] = field(default_factory=list)   # committed, journaled
    logprobs: list[gp.TokenLogprob] = field(default_factory=list)  # per output id, if asked
    num_sent: int = 0                                      # token ids given to the client
    sent_text: str = ""
    stats: SpecStats = field(default_factory=SpecStats)
    model_pair: str = ""
    replica: str = ""
    finish_reason: str = ""
    num_cached_tokens: int | None = None  # prompt positions the first replica had cached


class CallContext(Protocol):
    """What the service needs from a call, whatever carries it: grpc.ServicerContext, or
    router.http_api.HttpCall for the HTTP API."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]: ...

    def time_remaining(self) -> float | None: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, store, replicas: ReplicaSet,
                 auth: Authenticator, limits: ServiceLimits = ServiceLimits(),
                 telemetry: RouterTelemetry | None = None,
                 sampling_defaults: dict | None = None,
                 admission: Admission | None = None,
                 serves: Callable[[pb.Load], bool] | None = None) -> None:
        """One model's service; `serves`: which of the router's replicas serve it
        (router/models.py; None: all)."""
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.serves = serves
        self.sampling_defaults = sampling_defaults or {}  # generation_config.json's
        # structured outputs are compiled here before any replica sees them (§3.8)
        self.grammars = Grammars(tokenizer.path, tokenizer.vocab_size, ())
        self.telemetry = telemetry or RouterTelemetry("")
        self.store, self.replicas, self.auth, self.limits = store, replicas, auth, limits
        self._priors: dict[tuple[str, str], tuple[float, list[float]]] = {}
        # (model pair, tag) -> requests that finished there with no drafted round
        self._undrafted: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._claims = ClaimKeeper(store, limits.journal_lease_s)
        # the router's, shared by the models it serves (router/models.py)
        self.admission = admission or Admission(limits.max_running, limits.max_queued,
                                                limits.max_queue_wait_s)
        if admission is None:  # (a shared one is watched once, by its owner)
            self.telemetry.metrics.watch_admission(self.admission)

    def close(self) -> None:
        self._claims.close()

    # -- RPCs --------------------------------------------------------------------------------
    def GenerateStream(self, request: gp.GenerateRequest, context):
        try:
            yield from self.responses(request, context)
        except Refused as refusal:
            _abort(context, refusal)

    def Generate(self, request: gp.GenerateRequest, context) -> gp.GenerateResponse:
        return merge_responses(list(self.GenerateStream(request, context)))

    def Status(self, request: gp.StatusRequest, context) -> gp.RouterStatus:
        try:
            self.authorize(context, request.tag)
        except Refused as refusal:
            _abort(context, refusal)
        replicas = replica_rows(self.replicas.live(self.serves))
        try:
            stats, reachable = self.store.acceptance_all(), True
        except StoreUnavailable:
            stats, reachable = {}, False
        acceptance = [gp.AcceptanceStats(model_pair=pair, tag=tag, tested_per_position=c.tested,
                                         accepted_per_position=c.accepted)
                      for (pair, tag), c in stats.items()
                      if not request.tag or client_tag(tag) == request.tag]
        return gp.RouterStatus(replicas=replicas, acceptance=acceptance,
                               is_store_reachable=reachable)

    # -- the transport-neutral core (gRPC above, HTTP in router/http_api.py) -----------------
    def responses(self, request: gp.GenerateRequest, context, is_admitted: bool = False):
        """The request's messages, the last with finish reason, usage and statistics;
        refusals raise Refused. `context` is a CallContext. The request takes its own
        admission slot unless its caller took it (`is_admitted`: HTTP admits a request's
        generations together)."""
        observed = self.telemetry.request(context)
        try:
            with contextlib.nullcontext() if is_admitted else self.admission.slots(1):
                job, journal = self._admit(request, context)
                observed.admitted(job)
                if journal.replay is not None:
                    observed.outcome = "OK"
                    yield journal.replay
                    return
                yield from self._journaled(job, context, observed, journal.resumed)
        except Refused as refusal:
            observed.refused(refusal.code, refusal.message)
            raise
        finally:
            observed.end()

    def _journaled(self, job: Job, context, observed: RequestTelemetry,
                   resumed: list[int] | None):
        is_finished = False
        try:
            with self._claims.holding(job.request_id):
                yield from self._run(job, context, observed, resumed)
            is_finished = True
        finally:
            if not is_finished:  # failed or abandoned: the same request id may try again
                self._drop_journal(job.request_id)

    # -- admission ---------------------------------------------------------------------------
    def _admit(self, request, context) -> tuple[Job, Journal]:
        try:
            job = validate(request, self.tokenizer, self.max_model_len, self.grammars,
                           self.sampling_defaults)
        except ValidationError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self.authorize(context, job.tag)
        if job.resume_from:
            return self._resume_journal(job)
        return job, Journal(replay=self._open_journal(job))

    def authorize(self, context, tag: str = "") -> None:
        """Refused unless the caller's key may use `tag` now (rate limits count it)."""
        try:
            self.auth.check(context.invocation_metadata(), tag)
        except AuthError as exc:
            raise Refused(exc.code, exc.message, exc.retry_after_s) from None

    def _open_journal(self, job: Job) -> gp.GenerateResponse | None:
        """A finished request with this id: its response again. One still running, or a
        different request under the same id: refused."""
        record = st.JournalRecord(fingerprint=job.fingerprint, prompt_ids=job.prompt_ids,
                                  seed=job.params.seed)
        try:
            existing = self.store.journal_start(job.request_id, record,
                                                self.limits.journal_ttl_s,
                                                self.limits.journal_lease_s)
        except StoreUnavailable:
            return None  # no idempotency without the store; the request still runs
        if existing is None:
            return None
        if existing.fingerprint != job.fingerprint:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id {job.request_id!r} was used for a different request")
        if not existing.is_finished:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id {job.request_id!r} is still running", retry_after_s=1.0)
        return gp.GenerateResponse.FromString(existing.response)

    def _resume_journal(self, job: Job) -> tuple[Job, Journal]:
        """A stream resumed after its router failed (§9.4): its journal's tokens to go on
        from, with its seed; a finished one's response from where the client stopped."""
        try:
            found = self.store.journal_resume(job.request_id, self.limits.journal_lease_s)
        except StoreUnavailable:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the shared store cannot be reached: "
                          "nothing to resume from", retry_after_s=1.0) from None
        if found is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"request_id {job.request_id!r} has no journal to resume from")
        if found.record.fingerprint != job.fingerprint:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id {job.request_id!r} was used for a different request")
        if found.record.is_finished:
            whole = gp.GenerateResponse.FromString(found.record.response)
            return job, Journal(replay=self._tail(whole, job))
        if not found.is_claimed:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id {job.request_id!r} is still running", retry_after_s=1.0)
        if len(found.token_ids) < job.resume_from:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"resume_from is {job.resume_from}, but the journal holds "
                          f"{len(found.token_ids)} tokens")
        job = replace(job, params=replace(job.params, seed=found.record.seed))
        return job, Journal(resumed=found.token_ids)

    def _tail(self, whole: gp.GenerateResponse, job: Job) -> gp.GenerateResponse:
        """A finished response after the client's first `resume_from` tokens."""
        head = job.text_stream(self.tokenizer).push(list(whole.token_ids[:job.resume_from]))
        tail = gp.GenerateResponse()
        tail.CopyFrom(whole)
        tail.text = whole.text[len(head):]
        del tail.token_ids[:job.resume_from], tail.logprobs[:job.resume_from], tail.rounds[:]
        return tail

    # -- generation --------------------------------------------------------------------------
    def _run(self, job: Job, context, observed: RequestTelemetry, resumed: list[int] | None):
        progress = Progress(job, job.text_stream(self.tokenizer))
        if resumed is not None:
            catch_up = self._catch_up(progress, resumed)
            if catch_up.token_ids or catch_up.text:
                yield catch_up
        tried: set[str] = set()
        attempts = 1
        while not progress.finish_reason:
            replica = self._pick(job, tried)
            tried.add(replica.address)
            progress.replica, progress.model_pair = replica.address, replica.load.model_pair
            try:
                yield from self._stream_from(replica.address, progress, context, observed)
            except grpc.RpcError as exc:
                self._after_failure(exc, progress, attempts)
                observed.migrated(replica.address, exc.code().name)
            if not progress.finish_reason and attempts > self.limits.max_migrations:
                raise Refused(grpc.StatusCode.INTERNAL, f"target replica {replica.address} "
                              "ended the stream without finishing the request")
            attempts += 1
        final = self._finish(progress)
        # the replica keeps the whole sequence's KV but for the last token: a next turn's
        # prompt that repeats it finds it there
        self.replicas.note_prefix(progress.replica, [*job.prompt_ids, *progress.output_ids[:-1]])
        observed.finished(progress.finish_reason, progress.num_sent, progress.stats,
                          progress.replica, progress.num_cached_tokens or 0)
        yield final

    def _catch_up(self, progress: Progress, resumed: list[int]) -> gp.GenerateResponse:
        """Progress as the failed router left it: the client's tokens taken silently,
        the delta of those it committed but never sent."""
        job = progress.job
        progress.output_ids = list(resumed)
        progress.sent_text = progress.text.push(resumed[:job.resume_from])
        progress.num_sent = progress.text.num_tokens
        text = progress.text.push(resumed[job.resume_from:])
        if progress.text.is_stopped:
            progress.finish_reason = "stop"
        elif len(resumed) >= job.params.max_tokens:
            progress.finish_reason = "length"
            text += progress.text.finish()
        return self._delta(progress, text, [])

    def _pick(self, job: Job, tried: set[str]):
        deadline = time.monotonic() + self.limits.replica_wait_s
        while True:
            replica = self.replicas.pick(lambda pair: self._routing_acceptance(pair, job),
                                         tried, self.limits.max_waiting, job.prompt_ids,
                                         job.params.max_tokens, job.request_id, self.serves)
            if replica is not None:
                return replica
            if time.monotonic() >= deadline:
                if self.replicas.live(self.serves):
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  "every target replica's queue is full", retry_after_s=1.0)
                raise Refused(grpc.StatusCode.UNAVAILABLE, "no target replica of model "
                              f"{self.telemetry.model_name!r} is available (a replica serves "
                              "the router's model when its vocabulary and its checkpoint "
                              "dir's name are the same)", retry_after_s=2.0)
            time.sleep(0.1)

    def _stream_from(self, address: str, progress: Progress, context,
                     observed: RequestTelemetry):
        request = self._target_request(progress)
        request.traceparent = observed.traceparent()
        try:
            with self.replicas.link(address).start(request) as feed:
                context.add_callback(feed.cancel)  # a client that leaves frees the replica's work
                if getattr(context, "is_reader_watched", False):
                    feed.unread_timeout_s = None  # the HTTP API watches its socket instead
                for chunk in feed.chunks(remaining_timeout(context)):
                    if chunk.token_ids:  # its prefill is done: no longer queued there
                        self.replicas.prefilled(address, request.request_id)
                    message = self._take_chunk(progress, chunk, feed)
                    observed.streamed(len(message.token_ids), chunk.rounds)
                    yield message
                    if progress.finish_reason:
                        return
        finally:
            self.replicas.prefilled(address, request.request_id)

    def _take_chunk(self, progress: Progress, chunk: pb.TargetChunk,
                    feed) -> gp.GenerateResponse:
        """Journal a replica's chunk, detokenise it, apply stop strings: the client's delta."""
        job = progress.job
        self._journal(job.request_id, list(chunk.token_ids))
        progress.output_ids.extend(chunk.token_ids)
        progress.logprobs.extend(chunk.logprobs)
        if progress.num_cached_tokens is None and chunk.token_ids:
            progress.num_cached_tokens = min(chunk.num_cached_tokens, len(job.prompt_ids))
        for r in chunk.rounds:
            progress.stats.record(r.gamma, r.num_accepted, r.free_kind, r.num_free,
                                  r.model_method)
        delta = progress.text.push(list(chunk.token_ids))
        if progress.text.is_stopped:
            feed.cancel()
            progress.finish_reason = "stop"
        elif chunk.finish_reason:
            progress.finish_reason = chunk.finish_reason
            delta += progress.text.finish()
        return self._delta(progress, delta, chunk.rounds)

    def _after_failure(self, exc: grpc.RpcError, progress: Progress, attempts: int) -> None:
        code = exc.code()
        if isinstance(exc, StreamUnread):  # backpressure: nothing to say of the replica
            self.telemetry.metrics.unread.inc()
            raise Refused(code, exc.details()) from None
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise Refused(code, exc.details()) from None
        if code in MIGRATE_ON:  # not CANCELLED: a caller that left says nothing of the replica
            self.replicas.mark_down(progress.replica)
        if code not in MIGRATE_ON or attempts > self.limits.max_migrations:
            raise Refused(code if code != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL,
                          f"target replica {progress.replica} failed: {exc.details()}",
                          retry_after_s=1.0 if code in MIGRATE_ON else 0.0) from None
        # else: the loop resumes on another replica from the committed tokens

    def _target_request(self, progress: Progress) -> pb.TargetRequest:
        job = progress.job
        p = job.params
        return pb.TargetRequest(
            request_id=job.request_id, prompt_ids=job.prompt_ids,
            resume_output_ids=progress.output_ids, sampling=sampling_to_proto(p, p.seed),
            max_tokens=p.max_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
            spec_mode=TARGET_MODES[job.mode], gamma=job.gamma_max,
            acceptance_prior=self._prior(progress.model_pair, job.stats_tag),
            logprobs=p.logprobs, proposer=job.proposer, tree_topk=job.tree[0],
            tree_tokens=job.tree[1])

    def _delta(self, progress: Progress, text: str, rounds) -> gp.GenerateResponse:
        consumed = progress.text.num_tokens
        ids = progress.output_ids[progress.num_sent:consumed]
        logprobs = progress.logprobs[progress.num_sent:consumed]
        progress.num_sent = consumed
        progress.sent_text += text
        msg = gp.GenerateResponse(request_id=progress.job.request_id, text=text, token_ids=ids,
                                  replica=progress.replica, logprobs=logprobs,
                                  usage=gp.Usage(prompt_tokens=len(progress.job.prompt_ids),
                                                 completion_tokens=consumed))
        if progress.job.include_rounds:
            msg.rounds.extend(gp.Round(gamma=r.gamma, num_accepted=r.num_accepted, heat=r.heat,
                                       draft_version=r.draft_version, free_kind=r.free_kind,
                                       num_free=r.num_free, model_method=r.model_method,
                                       tree_nodes=r.tree_nodes, cache_rank=r.cache_rank)
                              for r in rounds)
        return msg

    def _finish(self, progress: Progress) -> gp.GenerateResponse:
        """The last message: finish reason, usage, speculation statistics."""
        job = progress.job
        final = gp.GenerateResponse(
            request_id=job.request_id, finish_reason=progress.finish_reason,
            usage=gp.Usage(prompt_tokens=len(job.prompt_ids),
                           completion_tokens=progress.num_sent,
                           cached_prompt_tokens=progress.num_cached_tokens or 0),
            speculation=progress.stats.to_proto(), replica=progress.replica)
        self._record(progress, final)
        return final

    # -- shared state ------------------------------------------------------------------------
    def _journal(self, request_id: str, token_ids: list[int]) -> None:
        # without the store the router itself still holds the tokens for a resume
        with contextlib.suppress(StoreUnavailable):
            self.store.journal_append(request_id, token_ids, self.limits.journal_ttl_s)

    def _drop_journal(self, request_id: str) -> None:
        with contextlib.suppress(StoreUnavailable):
            self.store.journal_drop(request_id)

    def _record(self, progress: Progress, final: gp.GenerateResponse) -> None:
        job = progress.job
        whole = merge_responses([gp.GenerateResponse(
            text=progress.sent_text, token_ids=progress.output_ids[:progress.num_sent],
            logprobs=progress.logprobs[:progress.num_sent]), final])
        record = st.JournalRecord(fingerprint=job.fingerprint, prompt_ids=job.prompt_ids,
                                  is_finished=True, response=whole.SerializeToString(),
                                  seed=job.params.seed)
        counts = progress.stats.counts
        if not counts.tested and progress.model_pair:
            key = (progress.model_pair, job.stats_tag)
            with self._lock:
                _put_newest(self._undrafted, key, self._undrafted.get(key, 0) + 1)
        try:
            self.store.journal_finish(job.request_id, record, self.limits.journal_ttl_s)
            if counts.tested and progress.model_pair:
                self.store.add_acceptance(progress.model_pair, job.stats_tag, counts)
        except StoreUnavailable:
            pass

    def _routing_acceptance(self, pair: str, job: Job) -> Acceptance:
        """What the choice of replica believes `job` keeps of a replica's pair's drafts:
        the shared statistics for its tag; for a pair with a draft that nothing was
        measured for, PRIOR_ALPHA, so that it is tried (else a second draft for a target
        would never get a request to learn from), until UNTRIED_REQUESTS of its requests
        finished there without a drafted round (its AUTO stands aside: it serves plain
        steps); for a pair without a draft model (lookups alone), or a request with
        speculation off, nothing."""
        if job.mode is SpecMode.OFF:
            return Acceptance([])
        alphas = self._prior(pair, job.stats_tag)
        if alphas or not pair_has_draft(pair):
            return Acceptance(alphas)
        with self._lock:
            quiet = self._undrafted.get((pair, job.stats_tag), 0)
        return Acceptance([PRIOR_ALPHA] if quiet < UNTRIED_REQUESTS else [])

    def _prior(self, pair: str, tag: str) -> list[float]:
        """Per-position acceptance to start AUTO requests from: the shared statistics
        for this model pair and tag (empty: the replica's own)."""
        if not pair:
            return []
        now = time.monotonic()
        with self._lock:
            cached = self._priors.get((pair, tag))
        if cached and now - cached[0] < self.limits.prior_cache_s:
            return cached[1]
        try:
            alphas = self.store.acceptance(pair, tag).alphas()
        except StoreUnavailable:
            alphas = cached[1] if cached else []
        with self._lock:
            _put_newest(self._priors, (pair, tag), (now, alphas))
        return alphas


def _put_newest(entries: dict, key, value) -> None:
    """entries[key] = value, made the newest; the oldest dropped beyond
    MAX_ACCEPTANCE_ENTRIES (a new draft version is a new model pair: keys keep coming)."""
    entries.pop(key, None)
    entries[key] = value
    while len(entries) > MAX_ACCEPTANCE_ENTRIES:
        del entries[next(iter(entries))]


def merge_responses(parts: list[gp.GenerateResponse]) -> gp.GenerateResponse:
    """A stream's messages as one response (what unary Generate returns)."""
    out = gp.GenerateResponse()
    for part in parts:
        out.MergeFrom(part)  # appends token_ids and rounds; the last message sets the rest
    out.text = "".join(p.text for p in parts)
    return out


def replica_rows(records: list[st.ReplicaRecord]) -> list[gp.Replica]:
    """Status's rows of the live replicas, by address."""
    now = time.time()
    return [gp.Replica(address=r.address, model_pair=r.load.model_pair, heat=r.load.heat,
                       num_running=r.load.num_running, num_waiting=r.load.num_waiting,
                       kv_used_blocks=r.load.kv_used_blocks,
                       kv_total_blocks=r.load.kv_total_blocks,
                       tokens_per_s=r.load.tokens_per_s, age_s=now - r.heartbeat_unix_s)
            for r in sorted(records, key=lambda r: r.address)]


def _abort(context, refusal: Refused) -> None:
    if refusal.retry_after_s:
        wait_ms = str(int(refusal.retry_after_s * 1000))
        trailers = [("retry-after-ms", wait_ms)]
        if refusal.code == grpc.StatusCode.UNAVAILABLE:  # clients' gRPC retries wait this long
            trailers.append(("grpc-retry-pushback-ms", wait_ms))
        context.set_trailing_metadata(tuple(trailers))
    context.abort(refusal.code, refusal.message)
