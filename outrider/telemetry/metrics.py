"""Prometheus metrics of the router, target and draft replicas.

Speculative-decoding counters carry vLLM's names and labels (model_name, engine), so
queries written for vLLM work on Outrider's target replicas unchanged; so do its request
latency histograms on the router. What vLLM has no name for is `outrider_*`. Families
are module-level (one per process, as Prometheus wants); the classes bind labels."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from outrider.core.load import ReplicaLoad
from outrider.core.policy import Referee, load_range
from outrider.core.sequence import RoundStats
from outrider.core.stats import MODEL_METHOD, by_proposer

disable_created_metrics()  # no *_created series: as vLLM, and half the scrape size

MAX_POSITIONS = 16  # MAX_GAMMA: per-position counters exist for positions 0..15
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
GAMMA_BUCKETS = tuple(range(MAX_POSITIONS + 1))
HEAT_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 4.0)
ENGINE = ["model_name", "engine"]
MODEL = ["model_name"]

# -- target replicas (vLLM's engine metrics) ----------------------------------------------
# by proposer: method "draft_model" (or a head's "eagle3", "eagle", "medusa", the
# target's own layers' "layer_skip", a draft of another tokenizer's "cross_vocab", bound
# when it first drafts), "ngram", "suffix",
# "lookahead" or "grammar" (tokens a grammar forced) (a round's first proposal's, for num_drafts; a
# round whose looked-up or forced tokens the model continued counts its tokens under both)
METHODS = ("draft_model", "ngram", "suffix", "lookahead", "grammar")
SPEC_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Speculative rounds verified",
                      [*ENGINE, "method"])
SPEC_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                            [*ENGINE, "method"])
SPEC_ACCEPTED_TOKENS = Counter("vllm:spec_decode_num_accepted_tokens",
                               "Draft tokens accepted", [*ENGINE, "method"])
SPEC_ACCEPTED_PER_POS = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by position in the draft",
                                [*ENGINE, "position"])
SPEC_DRAFTED_PER_POS = Counter("outrider_spec_drafted_tokens_per_pos",
                               "Draft tokens proposed, by position (the denominator of "
                               "per-position acceptance when γ varies)", [*ENGINE, "position"])
# acceptance per draft weights' version (online distillation): accepted / drafted
SPEC_DRAFT_TOKENS_BY_VERSION = Counter("outrider:spec_decode_draft_tokens_by_version",
                                       "Draft tokens proposed, by the draft's weights version",
                                       [*ENGINE, "draft_version"])
SPEC_ACCEPTED_BY_VERSION = Counter("outrider:spec_decode_accepted_tokens_by_version",
                                   "Draft tokens accepted, by the draft's weights version",
                                   [*ENGINE, "draft_version"])
GRAMMAR_MASK_SECONDS = Histogram("outrider_grammar_mask_seconds", "Time a step spent on "
                                 "its constrained rows' grammar masks", ENGINE,
                                 buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
# the engine thread's steps: whatever of their wall time is neither its own CPU time nor a
# wait for the proposer, it waited otherwise: for the GIL (the process's gRPC threads) or
# for the forward's intra-op threads (their CPU time is theirs, not the engine thread's)
TREE_ROUNDS = Counter("outrider_spec_tree_rounds", "Rounds verified as token trees "
                      "(docs/DESIGN.md §8.9)", ENGINE)
TREE_NODES = Counter("outrider_spec_tree_nodes", "Tree nodes verified (their rounds' "
                     "accepted depth: vllm:spec_decode_num_accepted_tokens)", ENGINE)
ENGINE_STEPS = Counter("outrider_engine_steps", "Steps the engine thread ran", ENGINE)
CACHE_ROUNDS = Counter("outrider_spec_cache_rounds", "Rounds whose drafts came ready from a "
                       "draft replica's speculation cache, by the rank of the outcome they "
                       "were prepared for (1: the likeliest; docs/DESIGN.md §2.6)",
                       [*ENGINE, "rank"])
READY_ONLY_STEPS = Counter("outrider_spec_cache_ready_only_steps", "Steps whose Proposes "
                           "asked for ready drafts only: a sequence the speculation cache "
                           "missed verified none", ENGINE)
DELIVERED_ROUNDS = Counter("outrider_spec_cache_delivered_rounds", "Rounds whose drafts a "
                           "draft replica's speculation cache delivered beside the last "
                           "verification: no Propose was asked for them", ENGINE)
ENGINE_STEP_SECONDS = Counter("outrider_engine_step_seconds", "The engine thread's steps: "
                              "their wall time (part=wall), its CPU time in them (cpu) and "
                              "the time off its CPU waiting for the proposer "
                              "(proposer_wait)",
                              [*ENGINE, "part"])
ENGINE_SWITCHES = Gauge("outrider_engine_context_switches", "The engine thread's context "
                        "switches since it started (/proc), by kind", [*ENGINE, "kind"])
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Tokens generated", ENGINE)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens admitted", ENGINE)
SPEC_GAMMA = Histogram("outrider_spec_gamma", "γ chosen per sequence per round",
                       [*ENGINE, "mode"], buckets=GAMMA_BUCKETS)
ROUND_HEAT = Histogram("outrider_spec_heat", "Batch heat of every sequence's round, by "
                       "whether it speculated", [*ENGINE, "speculated"], buckets=HEAT_BUCKETS)
LOAD_GAUGES = {
    "num_running": Gauge("vllm:num_requests_running", "Sequences in the running batch", ENGINE),
    "num_waiting": Gauge("vllm:num_requests_waiting", "Sequences queued", ENGINE),
    "kv_usage": Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use", ENGINE),
    "heat": Gauge("outrider_batch_heat", "Queued token demand / the step's token budget",
                  ENGINE),
    "tokens_per_s": Gauge("outrider_tokens_per_second",
                          "Tokens committed per second (EWMA over steps)", ENGINE),
}

# -- routers (vLLM's request metrics, measured where requests enter) ----------------------
TTFT = Histogram("vllm:time_to_first_token_seconds", "Time to first token", MODEL,
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("vllm:inter_token_latency_seconds", "Time between tokens (a chunk of n "
                "tokens counts n gaps of its time / n)", MODEL, buckets=LATENCY_BUCKETS)
E2E = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end", MODEL,
                buckets=LATENCY_BUCKETS)
REQUEST_SUCCESS = Counter("vllm:request_success", "Requests finished, by reason",
                          [*MODEL, "finished_reason"])
REQUESTS = Counter("outrider_requests", "Requests answered, by gRPC status code (HTTP "
                   "requests by the code behind their status)", [*MODEL, "code", "api"])
ROUTER_TOKENS = Counter("outrider_router_generation_tokens", "Tokens streamed to clients",
                        MODEL)
ADMITTED = Gauge("outrider_router_generations_running", "Generations holding an admission "
                 "slot (gRPC and HTTP together)", MODEL)
QUEUED = Gauge("outrider_router_generations_queued", "Generations waiting for an admission "
               "slot", MODEL)
UNREAD = Counter("outrider_router_streams_unread", "Streams cancelled because their client "
                 "stopped reading (backpressure)", MODEL)
IGNORED_FIELDS = Counter("outrider_router_ignored_fields", "Unknown fields in HTTP request "
                         "bodies, ignored (a client sending what this router does not do)",
                         MODEL)
MIGRATIONS = Counter("outrider_request_migrations", "Requests moved to another replica after "
                     "a failure", MODEL)
STRUCTURED = Counter("outrider_structured_requests", "Requests finished under an output "
                     "constraint, by kind", [*MODEL, "kind"])
STRUCTURED_DRAFT_TOKENS = Counter("outrider_structured_draft_tokens", "Draft tokens proposed "
                                  "to constrained requests, by kind", [*MODEL, "kind"])
STRUCTURED_ACCEPTED_TOKENS = Counter("outrider_structured_accepted_tokens", "Draft tokens "
                                     "accepted in constrained requests, by kind",
                                     [*MODEL, "kind"])

# -- draft replicas -----------------------------------------------------------------------
DRAFT_PROPOSALS = Counter("outrider_draft_proposals", "Sequences drafted for", MODEL)
DRAFT_TOKENS = Counter("outrider_draft_tokens", "Tokens drafted", MODEL)
DRAFT_MISSES = Counter("outrider_draft_misses", "Proposals refused for want of the "
                       "sequence's cache (the target resends the context)", MODEL)
DRAFT_SECONDS = Histogram("outrider_draft_propose_seconds", "Time to draft one Propose",
                          MODEL, buckets=LATENCY_BUCKETS)
SPEC_CACHE_LOOKUPS = Counter("outrider_draft_speculation_cache_lookups", "Sequences a Propose "
                             "asked drafts for that the speculation cache had prepared for: "
                             "result hit (answered at once) or miss (drafted then), by the "
                             "drafts the target kept of the round prepared for (accepted; "
                             "0 also a round that had none; none: the tokens sent are not "
                             "that round's outcome)",
                             [*MODEL, "result", "accepted"])
SPEC_CACHE_STAND_INS = Counter("outrider_draft_speculation_cache_stand_ins", "Outcomes the "
                               "speculation cache drafted for while the target verified", MODEL)
DRAFT_CACHED = Gauge("outrider_draft_cached_sequences", "Sequences whose KV the draft holds",
                     MODEL)
DRAFT_VERSION = Gauge("outrider:draft_version", "Draft weights version serving (0: as loaded; "
                      "online distillation adopts 1, 2, ...)", MODEL)
DRAFT_AGREEMENT = Gauge("outrider_draft_heldout_agreement", "Held-out top-1 agreement with "
                        "the target's tokens at the last adaptation round", [*MODEL, "weights"])
DRAFT_TRAINING = Gauge("outrider_draft_training", "1 while an online distillation round "
                       "trains (0 otherwise)", MODEL)
DRAFT_ADAPT_ROUNDS = Counter("outrider_draft_adapt_rounds", "Online distillation rounds, by "
                             "whether the trained weights were adopted", [*MODEL, "adopted"])
DRAFT_ROLLBACKS = Counter("outrider_draft_rollbacks", "Adopted draft versions rolled back: "
                          "their live acceptance fell short of the version before", MODEL)
DRAFT_TRAINER = Gauge("outrider_draft_trainer", "1 while this replica trains its pair's "
                      "draft (holds the trainer lease, or trains alone)", MODEL)


class PrefixCacheCounters:
    """Queried and hit token counts of a BlockManager, read at scrape time (the block
    manager counts; Prometheus sees counters). Names end in _total in the exposition."""

    def __init__(self, prefix: str, labels: dict[str, str], blocks) -> None:
        self.prefix, self.labels, self.blocks = prefix, labels, blocks

    def collect(self):
        for name, doc, value in (
                ("queries", "Prefix cache queries, in tokens looked up",
                 self.blocks.num_queried_tokens),
                ("hits", "Prefix cache hits, in tokens found cached", self.blocks.num_hit_tokens)):
            family = CounterMetricFamily(f"{self.prefix}prefix_cache_{name}", doc,
                                         labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family

    def describe(self):
        return []  # registered unchecked: a replica registers its own once


def watch_prefix_cache(prefix: str, labels: dict[str, str], blocks) -> PrefixCacheCounters:
    collector = PrefixCacheCounters(prefix, labels, blocks)
    REGISTRY.register(collector)
    return collector


class RefereeGauges:
    """The γ policy's referee (docs/DESIGN.md §4.4), read at scrape time: the goodput it
    measured per load and arm, and the arm it runs at each load now."""

    def __init__(self, labels: dict[str, str], referee: Referee) -> None:
        self.labels, self.referee = labels, referee

    def collect(self):
        names, values = [*self.labels, "load"], list(self.labels.values())
        rates = GaugeMetricFamily("outrider_referee_goodput_tokens_per_second",
                                  "Tokens per second of the engine's epochs under AUTO's "
                                  "arm (model: the γ model's choice; plain: γ 0), EWMA",
                                  labels=[*names, "arm"])
        arms = GaugeMetricFamily("outrider_referee_speculates", "1 while AUTO requests at "
                                 "this load run as the γ model chooses, 0 while plain",
                                 labels=names)
        for bucket, record in sorted(list(self.referee.loads.items())):
            load = [*values, load_range(bucket)]
            for arm, rate in list(record.rates.items()):
                rates.add_metric([*load, "model" if arm else "plain"], rate)
            arms.add_metric(load, float(record.speculates))
        yield rates
        yield arms

    def describe(self):
        return []  # registered unchecked, as PrefixCacheCounters


class TargetMetrics:
    """Per round of every sequence: the speculation counters; per scrape: load gauges."""

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.labels = {"model_name": model_name, "engine": engine}
        self._methods: dict[str, tuple] = {}  # method -> its counters (_counters)
        for method in METHODS:
            self._counters(method)
        self.accepted_at = [SPEC_ACCEPTED_PER_POS.labels(**self.labels, position=str(p))
                            for p in range(MAX_POSITIONS)]
        self.drafted_at = [SPEC_DRAFTED_PER_POS.labels(**self.labels, position=str(p))
                           for p in range(MAX_POSITIONS)]
        self.generation_tokens = GENERATION_TOKENS.labels(**self.labels)
        self.prompt_tokens = PROMPT_TOKENS.labels(**self.labels)
        self.mask_seconds = GRAMMAR_MASK_SECONDS.labels(**self.labels)
        # children bound once: record_round runs per sequence per round
        self._gamma = {m: SPEC_GAMMA.labels(**self.labels, mode=m)
                       for m in ("auto", "off", "fixed")}
        self._heat = {b: ROUND_HEAT.labels(**self.labels, speculated=str(b).lower())
                      for b in (False, True)}
        self._by_version: dict[int, tuple] = {}  # draft version -> (drafted, accepted)
        self._steps = ENGINE_STEPS.labels(**self.labels)
        self._ready_only_steps = READY_ONLY_STEPS.labels(**self.labels)
        self._delivered_rounds = DELIVERED_ROUNDS.labels(**self.labels)
        self._trees = (TREE_ROUNDS.labels(**self.labels), TREE_NODES.labels(**self.labels))
        self._step_seconds = [ENGINE_STEP_SECONDS.labels(**self.labels, part=part)
                              for part in ("wall", "cpu", "proposer_wait")]

    def _counters(self, method: str) -> tuple:
        """(rounds, draft tokens, accepted tokens) of `method`: children looked up once,
        a head's when it first drafts."""
        if method not in self._methods:
            self._methods[method] = tuple(c.labels(**self.labels, method=method) for c in (
                SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS))
        return self._methods[method]

    def record_round(self, r: RoundStats, mode: str, num_tokens: int) -> None:
        """One sequence's round: γ proposals (the first num_free looked up, the rest
        drafted by weights `draft_version`), `num_accepted` of them kept, `num_tokens`
        committed."""
        gamma, accepted, draft_version = r.gamma, r.num_accepted, r.draft_version
        self.generation_tokens.inc(num_tokens)
        self._gamma[mode].observe(gamma)
        self._heat[gamma > 0].observe(r.heat)
        if not gamma:
            return
        if r.cache_rank:
            CACHE_ROUNDS.labels(**self.labels, rank=str(r.cache_rank)).inc()
        self._counters(r.free_kind or r.model_method or MODEL_METHOD)[0].inc()
        parts = by_proposer(gamma, accepted, r.free_kind, r.num_free, r.model_method)
        for method, (proposed, kept) in parts.items():
            _, proposed_total, kept_total = self._counters(method)
            proposed_total.inc(proposed)
            kept_total.inc(kept)
        for p in range(gamma):
            self.drafted_at[p].inc()
        for p in range(accepted):
            self.accepted_at[p].inc()
        modelled = parts.get(r.model_method or MODEL_METHOD)
        if modelled:  # the draft weights' own acceptance (a head's too)
            drafted, kept = (self._by_version.get(draft_version)
                             or self._bind_version(draft_version))
            drafted.inc(modelled[0])
            kept.inc(modelled[1])

    def _bind_version(self, draft_version: int):
        labels = {**self.labels, "draft_version": str(draft_version)}
        pair = (SPEC_DRAFT_TOKENS_BY_VERSION.labels(**labels),
                SPEC_ACCEPTED_BY_VERSION.labels(**labels))
        self._by_version[draft_version] = pair
        return pair

    def record_step(self, wall_s: float, cpu_s: float, proposer_wait_s: float,
                    tree_rounds: int = 0, tree_nodes: int = 0, ready_only: bool = False,
                    delivered: int = 0) -> None:
        self._steps.inc()
        if delivered:
            self._delivered_rounds.inc(delivered)
        if ready_only:
            self._ready_only_steps.inc()
        if tree_rounds:
            self._trees[0].inc(tree_rounds)
            self._trees[1].inc(tree_nodes)
        for part, seconds in zip(self._step_seconds, (wall_s, cpu_s, proposer_wait_s)):
            part.inc(seconds)

    def watch_engine_thread(self) -> None:
        """The calling thread's context switches, read at scrape time: voluntary ones are
        waits (the GIL, the proposer), involuntary ones preemptions by other work."""
        status = f"/proc/self/task/{threading.get_native_id()}/status"
        for kind in ("voluntary", "nonvoluntary"):
            ENGINE_SWITCHES.labels(**self.labels, kind=kind).set_function(
                lambda kind=kind: _proc_count(status, f"{kind}_ctxt_switches"))

    def watch_load(self, load: Callable[[], ReplicaLoad]) -> None:
        """Gauges read at scrape time from the engine's load()."""
        readers = {"num_running": lambda: load().num_running,
                   "num_waiting": lambda: load().num_waiting,
                   "kv_usage": lambda: _fraction(load()),
                   "heat": lambda: load().heat,
                   "tokens_per_s": lambda: load().tokens_per_s}
        for key, read in readers.items():
            LOAD_GAUGES[key].labels(**self.labels).set_function(read)

    def watch_prefix_cache(self, blocks) -> None:
        """vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens)."""
        watch_prefix_cache("vllm:", self.labels, blocks)

    def watch_referee(self, referee: Referee) -> None:
        REGISTRY.register(RefereeGauges(self.labels, referee))


class RouterMetrics:
    """What clients experience."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.ttft, self.itl, self.e2e = (h.labels(model_name) for h in (TTFT, ITL, E2E))
        self.tokens = ROUTER_TOKENS.labels(model_name)
        self.migrations = MIGRATIONS.labels(model_name)
        self.unread = UNREAD.labels(model_name)
        self.ignored_fields = IGNORED_FIELDS.labels(model_name)

    def watch_admission(self, admission) -> None:
        """Gauges read at scrape time from the router's admission control."""
        ADMITTED.labels(self.model).set_function(lambda: admission.num_running)
        QUEUED.labels(self.model).set_function(lambda: admission.num_queued)

    def finished(self, reason: str) -> None:
        REQUEST_SUCCESS.labels(self.model, reason).inc()

    def structured(self, kind: str, draft_tokens: int, accepted_tokens: int) -> None:
        """A constrained request finished: its kind and what speculation did for it."""
        STRUCTURED.labels(self.model, kind).inc()
        STRUCTURED_DRAFT_TOKENS.labels(self.model, kind).inc(draft_tokens)
        STRUCTURED_ACCEPTED_TOKENS.labels(self.model, kind).inc(accepted_tokens)

    def answered(self, code: str, api: str) -> None:
        REQUESTS.labels(self.model, code, api).inc()


class DraftMetrics:
    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.proposals = DRAFT_PROPOSALS.labels(model_name)
        self.tokens = DRAFT_TOKENS.labels(model_name)
        self.misses = DRAFT_MISSES.labels(model_name)
        self.seconds = DRAFT_SECONDS.labels(model_name)
        self.rollbacks = DRAFT_ROLLBACKS.labels(model_name)
        self.stand_ins = SPEC_CACHE_STAND_INS.labels(model_name)

    def cache_lookup(self, accepted: int, hit: bool) -> None:
        """The speculation cache's (SpeculationCache.on_lookup): its hit rate per position."""
        SPEC_CACHE_LOOKUPS.labels(self.model, "hit" if hit else "miss",
                                  str(accepted) if accepted >= 0 else "none").inc()

    def watch_version(self, version: Callable[[], int]) -> None:
        DRAFT_VERSION.labels(self.model).set_function(version)

    def watch_training(self, is_training: Callable[[], bool]) -> None:
        DRAFT_TRAINING.labels(self.model).set_function(lambda: float(is_training()))

    def watch_trainer(self, is_trainer: Callable[[], bool]) -> None:
        DRAFT_TRAINER.labels(self.model).set_function(lambda: float(is_trainer()))

    def adapt_round(self, result) -> None:
        """One online distillation round (draft_worker/adapt.py AdaptRound)."""
        DRAFT_AGREEMENT.labels(self.model, "serving").set(result.serving_agreement)
        DRAFT_AGREEMENT.labels(self.model, "trained").set(result.trained_agreement)
        DRAFT_ADAPT_ROUNDS.labels(self.model, str(result.adopted).lower()).inc()

    def watch_cache(self, num_sequences: Callable[[], int], blocks) -> None:
        DRAFT_CACHED.labels(self.model).set_function(num_sequences)
        watch_prefix_cache("outrider_draft_", {"model_name": self.model}, blocks)


def exposition(*also) -> tuple[bytes, str]:
    """(body, content type) of a scrape: always the text format 0.0.4, which keeps
    vLLM's `vllm:` names; prometheus_client's OpenMetrics output, which Prometheus asks
    for first, would escape their colons to underscores. `also`: more collectors (the
    router's replicas, router/replica_metrics.py), a family of a name this process has
    too merged into one, as the format wants each name once."""
    return generate_latest(_Merged((REGISTRY, *also))), CONTENT_TYPE_PLAIN_0_0_4


class _Merged:
    def __init__(self, collectors) -> None:
        self.collectors = collectors

    def collect(self):
        families: dict[str, Metric] = {}
        for collector in self.collectors:
            for family in collector.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += family.samples
        return families.values()


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404, "try /metrics")
            return
        body, content_type = exposition()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes are not news
        pass


def serve_metrics(host: str, port: int, name: str, tries: int = 1) -> int:
    """Prometheus exposition at http://host:port/metrics; returns the bound port. With
    tries > 1 a taken port moves it to the next (replicas sharing a node)."""
    for attempt in range(tries):
        try:
            server = ThreadingHTTPServer((host, port + attempt if port else 0),
                                         _MetricsHandler)
            break
        except OSError:
            if attempt == tries - 1:
                raise
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = server.server_address[1]
    print(f"{name}: metrics at http://{host}:{bound}/metrics", flush=True)
    return bound


def _fraction(load: ReplicaLoad) -> float:
    return load.kv_used_blocks / load.kv_total_blocks if load.kv_total_blocks else 0.0


def _proc_count(status_file: str, field: str) -> float:
    """A field of a /proc status file (0 where there is none: not Linux, thread gone)."""
    try:
        with open(status_file) as f:
            return float(next(line.split()[1] for line in f if line.startswith(field)))
    except (OSError, StopIteration):
        return 0.0
