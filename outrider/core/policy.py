"""The γ policy (docs/DESIGN.md §4): how many tokens to speculate, per request and per round.

Pure Python, no torch: the router uses it to admit and route, and the target's scheduler
calls the same code every round. It maximises the expected goodput of the whole batch —
tokens per second over all running requests — from
  * batch heat (0 = idle, 1 = the step's token budget is full without speculation),
  * each request's per-position acceptance estimate (EWMA, warm-started from shared
    statistics for its model pair and workload tag),
  * a cost model measured on the replica at start-up (verify time vs batch tokens, draft
    time per drafting position and per drafted token, draft round trip) and kept true
    online by the replica's own step timings.
Speculation is switched off when the batch is hot and back on when it cools, with
hysteresis; per-request overrides (OFF, FIXED γ) always win. A referee holds the model to
what it promises: per load, epochs of its choice are measured against epochs of γ 0, and
where γ 0 serves more it runs plain, retrying the model now and then.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

MAX_GAMMA = 16  # the most draft tokens a request may ask for per round
MASK_BITS = 64  # positions a token tree's attention mask spans: a tree verifies fewer nodes
# requests a router queues on one replica; the replica keeps a handler thread for each
MAX_QUEUED_PER_REPLICA = 256
# estimates that put every AUTO request at γ = 0 are only corrected by drafting: after this
# many such steps in a row (the batch not hot), one step probes
PROBE_AFTER = 16
PROBE_REQUESTS = 4  # ... with γ = 1 for each AUTO request, in batches of at most this many
# each probe that finds speculation still not paying doubles the wait for the next, to
# this many steps; a step in which the optimum speculates brings it back to PROBE_AFTER
PROBE_AFTER_MAX = 128
# the referee (docs/DESIGN.md §4.4): steps an arm (the model's choice, or γ 0 for every
# AUTO request) runs before its goodput is read; while the model's choice wins one epoch
# in PLAIN_EVERY runs plain; while plain wins the model's choice is tried again once plain
# ran 4, 8, 16 ... RETRY_AFTER_MAX times as long as the model's last epoch took
EPOCH_STEPS = 16
PLAIN_EVERY = 8
RETRY_AFTER_MAX = 32

class SpecMode(Enum):
    AUTO = "auto"
    OFF = "off"
    FIXED = "fixed"


@dataclass(frozen=True)
class CostModel:
    """Seconds for one step of the replica."""

    verify_base_s: float         # a target forward with (almost) nothing in it
    verify_per_token_s: float    # each batch position past the knee
    draft_per_position_s: float  # each drafting position (the draft batches sequences)
    draft_rtt_s: float = 0.0     # the Propose round trip, paid once per speculative step
    knee_tokens: int = 0         # positions that ride free (memory-bound forward)
    draft_per_token_s: float = 0.0  # each drafted token (a drafting position's batch grows)
    # a step that verifies nothing (decode only) against the line (negative: cheaper)
    plain_offset_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.verify_base_s, self.verify_per_token_s, self.draft_per_position_s,
               self.draft_rtt_s, self.draft_per_token_s) < 0:
            raise ValueError("cost model times must be >= 0")

    def step_seconds(self, batch_tokens, max_gamma, draft_tokens=0):
        """Works on numbers and on numpy arrays alike."""
        return self.verify_seconds(batch_tokens) + self.draft_seconds(max_gamma, draft_tokens)

    def plain_seconds(self, batch_tokens):
        """A step with no verification row (every sequence decoding one token): the line,
        which verification steps mostly fit, moved by what plain steps measured (at
        least a tenth of it, whatever the noise)."""
        line = self.verify_seconds(batch_tokens)
        return np.maximum(line + self.plain_offset_s, 0.1 * line)

    def verify_seconds(self, batch_tokens):
        return self.verify_base_s + self.verify_per_token_s * np.maximum(
            0, np.asarray(batch_tokens) - self.knee_tokens)

    def draft_seconds(self, max_gamma, draft_tokens=0):
        draft = (self.draft_rtt_s + self.draft_per_position_s * np.asarray(max_gamma)
                 + self.draft_per_token_s * np.asarray(draft_tokens))
        return np.where(np.asarray(max_gamma) > 0, draft, 0.0)

    def draft_scaled(self, draft: float) -> CostModel:
        """The same model with every draft time × `draft`."""
        return replace(self, draft_per_position_s=self.draft_per_position_s * draft,
                       draft_rtt_s=self.draft_rtt_s * draft,
                       draft_per_token_s=self.draft_per_token_s * draft)


class OnlineCost:
    """The start-up cost model, kept true by the replica's own steps. Verify time is
    refitted as a line in batch tokens over the recent steps (exponentially weighted
    least squares: contention from neighbours and real batch shapes — contexts, prefill
    chunks — that the start-up runs did not have); when recent steps all had one size,
    only the line's base moves. The draft part keeps its start-up shape, scaled by an
    EWMA of measured over predicted Propose time. The line is fitted on the steps that
    verify; plain steps (nothing verified, one token a sequence) keep their own offset
    from it (EWMA weight 0.5 of their residuals). Fitted on both, it told neither: a
    replica speculating every step priced a plain step as a verification step (on CPU
    a plain step multiplies one row by each weight where verification multiplies
    several, a GEMV against a GEMM, +35 % a linear on the Xeon guests), and one
    speculating now and then in a large batch priced its verification steps as the
    plain steps around them, without the draft replica's contention for the cores."""

    def __init__(self, measured: CostModel, weight: float = 0.05,
                 plain_weight: float = 0.5) -> None:
        self.measured, self.weight, self.plain_weight = measured, weight, plain_weight
        self.draft_scale = 1.0
        self.plain_offset = measured.plain_offset_s
        self._sums = np.zeros(5)  # weighted count, Σx, Σy, Σx², Σxy (x: tokens, y: seconds)
        self.model = measured

    def observe(self, batch_tokens: int, verify_s: float, max_gamma: int = 0,
                draft_tokens: int = 0, draft_s: float = 0.0, is_plain: bool = False) -> None:
        """`is_plain`: the step verified nothing and every sequence decoded one token."""
        if verify_s > 0:
            # bounded: one stalled step (a page fault, a GC pause) must not flip the policy
            y = min(verify_s, 10 * float(self.model.verify_seconds(batch_tokens)))
            x = float(batch_tokens)
            if is_plain:  # its offset from the line: the policy's plain arm
                residual = y - float(self.model.verify_seconds(batch_tokens))
                self.plain_offset += self.plain_weight * (residual - self.plain_offset)
            else:  # the line is the verification steps' alone
                self._sums = (1 - self.weight) * self._sums + np.array([1.0, x, y, x * x, x * y])
        predicted = float(self.measured.draft_seconds(max_gamma, draft_tokens))
        if predicted > 0 and max_gamma:
            ratio = min(max(draft_s / predicted, 0.1), 10.0)
            self.draft_scale += self.weight * (ratio - self.draft_scale)
        self.model = replace(self.measured.draft_scaled(self.draft_scale), **self._verify_line(),
                             plain_offset_s=self.plain_offset)

    def _verify_line(self) -> dict:
        count, sx, sy, sxx, sxy = self._sums
        if count < 1.0:
            return {}
        spread = count * sxx - sx * sx  # count² × variance of the batch sizes
        if spread <= (0.05 * sx) ** 2:  # sizes within ~5 % of each other: no slope to see
            slope = self.measured.verify_per_token_s
        else:
            slope = max(0.0, (count * sxy - sx * sy) / spread)
        base = max(0.0, (sy - slope * sx) / count)
        return {"verify_base_s": base, "verify_per_token_s": slope, "knee_tokens": 0}


@dataclass(frozen=True)
class PolicyConfig:
    gamma_max: int = 8
    hot_heat: float = 0.9    # speculation off at or above this heat ...
    cool_heat: float = 0.7   # ... and back on at or below this one
    ewma_weight: float = 0.1  # weight of the newest round in the acceptance estimate
    # speculation is kept only where its expected goodput beats γ = 0 for everyone by
    # this share: estimates err (a request's α lags its text, a step's time its load;
    # served at T 0.7 on 2 cores, rounds the model priced at +2 % served 10-20 % less
    # than plain steps), and below this a gain is smaller than their error, while a loss
    # is paid in full
    min_gain: float = 0.10

    def __post_init__(self) -> None:
        if self.gamma_max < 0:
            raise ValueError("gamma_max must be >= 0")
        if not 0 <= self.min_gain < 1:
            raise ValueError("min_gain must be in [0, 1)")
        if not 0 <= self.cool_heat < self.hot_heat:
            raise ValueError("need 0 <= cool_heat < hot_heat (hysteresis)")
        if not 0 < self.ewma_weight <= 1:
            raise ValueError("ewma_weight must be in (0, 1]")


@dataclass
class Acceptance:
    """Per-position acceptance probabilities α_j: P(draft j accepted | drafts < j accepted)."""

    alphas: list[float]
    weight: float = 0.1

    def expected_tokens(self, gamma: int) -> float:
        """Tokens a round emits on average: the accepted prefix + one recovered/bonus."""
        total, survive = 1.0, 1.0
        for j in range(gamma):
            survive *= self.alpha(j)
            total += survive
        return total

    def alpha(self, position: int) -> float:
        return self.alphas[min(position, len(self.alphas) - 1)] if self.alphas else 0.0

    def drift(self, toward: list[float]) -> None:
        """A round without drafting says nothing of this request: its estimate moves
        toward `toward` (what the replica sees), so a request whose early rounds went
        badly is tried again rather than kept at γ = 0 for good."""
        for j, target in enumerate(toward[:len(self.alphas)]):
            self.alphas[j] += self.weight * (target - self.alphas[j])

    def update(self, gamma: int, num_accepted: int) -> None:
        """A round drafted `gamma` tokens and accepted the first `num_accepted`."""
        for j in range(min(gamma, num_accepted + 1)):  # positions actually tested
            while j >= len(self.alphas):
                self.alphas.append(self.alpha(j))
            hit = 1.0 if j < num_accepted else 0.0
            self.alphas[j] += self.weight * (hit - self.alphas[j])


@dataclass
class RequestState:
    acceptance: Acceptance
    mode: SpecMode = SpecMode.AUTO
    fixed_gamma: int = 0
    gamma_cap: int = 1 << 30  # what the request may still use (tokens left, context)
    draft_free: bool = False  # its proposals are looked up: no draft time (ngram, suffix)
    looks_up: bool = False    # the model drafts for it, and a lookup may stand in (AUTO)


def load_bucket(num_seqs: int) -> int:
    """Batches the referee compares alike: 1, 2, 3-5, 6-11, 12-22, 23-45, 46-90, 91-181,
    more (a closed loop of N streams runs N and N - 1 sequences: one bucket)."""
    return min(round(math.log2(max(num_seqs, 1))), 8)


def load_range(bucket: int) -> str:
    """A load bucket as the sequence counts it holds: '3-5', '182+'."""
    low, high = math.floor(2 ** (bucket - 0.5)) + 1, math.floor(2 ** (bucket + 0.5))
    return f"{low}+" if bucket == 8 else str(low) if low == high else f"{low}-{high}"


@dataclass
class LoadRecord:
    """What the referee knows of one load bucket, and the epoch it is running there."""

    speculates: bool = True  # this epoch's arm: the model's choice (else γ 0 for AUTO)
    since: int = PLAIN_EVERY - 2  # epochs of the model's arm in a row (new: plain after 1)
    retry_after: int = 4     # while plain wins: its seconds, × the model's last epoch's,
    plain_s: float = 0.0     # before the model's arm is tried again; run so far
    model_epoch_s: float = 0.0  # the last epoch of the model's arm that speculated
    rates: dict[bool, float] = field(default_factory=dict)  # arm -> EWMA tokens/s
    steps: int = 0           # this epoch's steps, tokens and seconds
    tokens: float = 0.0
    seconds: float = 0.0
    did_speculate: bool = False  # some step of this epoch speculated for AUTO

    def wins(self) -> bool | None:
        """Whether the model's arm measured at least plain's (None: not both yet)."""
        spec, plain = self.rates.get(True), self.rates.get(False)
        return None if spec is None or plain is None else spec >= plain


@dataclass
class Referee:
    """AUTO's speculation against speculation off, measured end to end (docs/DESIGN.md
    §4.4). The model decides from estimates, and estimates err in ways no refit sees: a
    step that verifies one drafted row runs every row on more threads and waits for the
    draft replica, and the router's streaming and the draft replica share the cores.
    Served at T 0.7 on 2 cores, a model whose every input was measured let AUTO draft
    for 2 % of rounds at 64 streams, nearly every step, at 0.80x speculation off.

    So each load bucket's steps run in epochs of EPOCH_STEPS under one arm: the model's
    choice or γ 0 for every AUTO request. Each epoch's goodput (tokens committed ÷ the
    engine's busy seconds) updates an EWMA per arm; an epoch of the model's arm in
    which nothing speculated counts as plain. Where plain measured better the model's
    arm is tried again once plain ran 4, 8 ... RETRY_AFTER_MAX times as long as the model's
    last epoch took (a speculating step can take three plain ones); where the model
    wins, one epoch in PLAIN_EVERY runs plain, which also keeps OnlineCost's plain
    offset measured; a load not measured yet trusts the model for one epoch. A model
    that is right loses an eighth of its gain; one that is wrong, at most a 33rd
    of its loss once measured."""

    weight: float = 0.3
    loads: dict[int, LoadRecord] = field(default_factory=dict)  # by load_bucket

    def at(self, num_seqs: int) -> LoadRecord:
        return self.loads.setdefault(load_bucket(num_seqs), LoadRecord())

    def observe(self, num_seqs: int, tokens: int, seconds: float, speculated: bool) -> None:
        """One step of the engine: the sequences it was chosen for, the tokens they
        committed, its time."""
        load = self.at(num_seqs)
        load.steps, load.tokens, load.seconds = (load.steps + 1, load.tokens + tokens,
                                                 load.seconds + seconds)
        load.did_speculate |= speculated
        if load.steps >= EPOCH_STEPS:
            self._close_epoch(load)

    def _close_epoch(self, load: LoadRecord) -> None:
        arm = load.speculates and load.did_speculate
        if load.seconds > 0:
            rate, old = load.tokens / load.seconds, load.rates.get(arm)
            load.rates[arm] = rate if old is None else old + self.weight * (rate - old)
        if arm:
            load.model_epoch_s = load.seconds
        load.since = load.since + 1 if load.speculates else 0
        load.plain_s = 0.0 if load.speculates else load.plain_s + load.seconds
        load.steps, load.tokens, load.seconds, load.did_speculate = 0, 0.0, 0.0, False
        if load.wins() is not False:  # the model trusted until plain measures better
            load.retry_after, load.speculates = 4, load.since < PLAIN_EVERY - 1
        else:  # retried once plain ran 4, 8 ... 32 times its last epoch: a share of time
            load.speculates = load.plain_s >= load.retry_after * load.model_epoch_s
            if load.speculates:
                load.retry_after = min(2 * load.retry_after, RETRY_AFTER_MAX)


@dataclass
class GammaPolicy:
    cfg: PolicyConfig
    cost: CostModel
    is_speculating: bool = True
    history: list[tuple[float, int]] = field(default_factory=list)  # (heat, mean γ)
    steps_off: int = 0  # steps in a row that speculated for no AUTO request, not hot
    referee: Referee = field(default_factory=Referee)  # the model's choice against plain
    speculated: bool = False  # the last choice speculated for an AUTO request ...
    num_seqs: int = 0         # ... of this many requests
    probe_after: int = PROBE_AFTER  # ... after which one probes (doubling while in vain)
    probed: list[int] = field(default_factory=list)  # the last choice's probed requests
    looked_up: list[int] = field(default_factory=list)  # ... and those given lookup rounds
    # positions the target verifies for a round of γ (a token tree's nodes; None: γ)
    width: Callable[[int], int] | None = None

    def observe_heat(self, heat: float) -> bool:
        """Hysteresis: off at hot_heat, on again only at cool_heat."""
        if heat >= self.cfg.hot_heat:
            self.is_speculating = False
        elif heat <= self.cfg.cool_heat:
            self.is_speculating = True
        return self.is_speculating

    def choose(self, heat: float, requests: list[RequestState]) -> list[int]:
        """γ for every running request this round."""
        speculating = self.observe_heat(heat)
        gammas = [self._override(r) for r in requests]
        self.probed, self.looked_up = [], []
        auto = [i for i, r in enumerate(requests) if r.mode is SpecMode.AUTO]
        self.num_seqs = len(requests)
        if speculating and auto and self.referee.at(self.num_seqs).speculates:
            self._maximise_goodput(requests, gammas, auto)
            self._probe_when_off(requests, gammas, auto)
            self._look_up_when_off(requests, gammas, auto)
        elif not speculating:
            self.steps_off = 0
        self.speculated = any(gammas[i] for i in auto)
        if requests:
            self.history.append((heat, sum(gammas) / len(gammas)))
            del self.history[:-1000]
        return gammas

    def observe_step(self, tokens: int, seconds: float) -> None:
        """The step the last choice planned, as it ran: into the referee."""
        self.referee.observe(self.num_seqs, tokens, seconds, self.speculated)

    def _probe_when_off(self, requests, gammas: list[int], auto: list[int]) -> None:
        """A replica whose estimates say no AUTO request should draft never drafts
        again, so they never learn otherwise: a few unlucky rounds at start-up, or one
        slow Propose (a draft compiling a grammar) scaling the draft's cost up, kept
        speculation off for whole runs. After PROBE_AFTER such steps one step drafts a
        single token (γ = 1, the cheapest test of α_0, which decides whether speculating
        pays) for each of them (`probed`: their proposer must be the model, since a
        lookup's round teaches the model's estimates nothing); what it finds teaches the
        requests', the replica's and the cost model's estimates. At most one Propose in
        PROBE_AFTER steps is spent, fewer while probes keep finding that speculation does
        not pay (the wait doubles each time, to PROBE_AFTER_MAX: a useless draft's probes
        cost a 1-stream server ~6 % of its rounds at a fixed 16), and none while the
        batch is hot. Only small batches
        probe (at most PROBE_REQUESTS AUTO requests): there a wrong "off" costs the most,
        and the draft stays at most PROBE_AFTER tokens behind each request; in a large
        one a probe makes the draft take in whole contexts it never held (a 32-stream
        soak's draft grew 12 % instead of 3 %), where batching already pays."""
        if any(gammas[i] for i in auto):
            self.steps_off, self.probe_after = 0, PROBE_AFTER
            return
        if len(auto) > PROBE_REQUESTS:
            self.steps_off = 0
            return
        self.steps_off += 1
        if self.steps_off < self.probe_after:
            return
        # the next probe waits twice as long unless this one turns speculation back on
        self.steps_off, self.probe_after = 0, min(2 * self.probe_after, PROBE_AFTER_MAX)
        self.probed = [i for i in auto if requests[i].gamma_cap > 0]
        for i in self.probed:
            gammas[i] = 1

    def _look_up_when_off(self, requests, gammas: list[int], auto: list[int]) -> None:
        """AUTO requests the model would not draft for (γ = 0: its acceptance or its time
        does not pay) may still look up, which costs verification rows and no draft time:
        seen in 1-stream runs where a slow draft kept γ at 0 while the suffix lookup's
        tokens were kept ~90 %. Those that can (`looks_up`) get the γ that draft-free
        positions at their estimate would earn beside the rest of the batch, and their
        round proposes a lookup alone (`looked_up`: nothing where nothing matches). The
        model's estimate stands in for the lookup's, which depends on the match the round
        finds; it is lower where lookups are kept (in those runs, 0.6 against 0.9)."""
        off = [i for i in auto
               if gammas[i] == 0 and requests[i].looks_up and i not in self.probed]
        if not off:
            return
        as_free = [replace(r, draft_free=True) if i in off else r
                   for i, r in enumerate(requests)]
        trial = list(gammas)
        self._maximise_goodput(as_free, trial, off)
        self.looked_up = [i for i in off if trial[i]]
        for i in self.looked_up:
            gammas[i] = trial[i]

    def _override(self, r: RequestState) -> int:
        if r.mode is SpecMode.FIXED:
            return max(0, min(r.fixed_gamma, r.gamma_cap))
        return 0

    def _maximise_goodput(self, requests, gammas: list[int], auto: list[int]) -> None:
        """Exact maximum of batch goodput over the AUTO requests' γ.

        For a given largest γ G (which sets the draft's time), adding draft position j
        to request i adds P(positions 0..j all accepted) expected tokens, one batch
        token and one drafted token; those marginal gains fall along j, so for G and a
        number k of added positions the best choice is the k largest gains. Every
        (G, k) is evaluated at once with numpy: O(G_max · n log n), no Python loop per
        candidate."""
        cost = self.cost
        is_auto = set(auto)
        fixed_tokens = sum(r.acceptance.expected_tokens(gammas[i])
                           for i, r in enumerate(requests) if i not in is_auto)
        width = self.width or (lambda g: g)
        base_batch = sum(1 + width(g) for g in gammas)  # AUTO rows start at γ = 0
        # looked-up proposals cost verification positions, not draft time
        drafted = [0 if r.draft_free else g for r, g in zip(requests, gammas)]
        base_drafts = sum(drafted)
        fixed_max = max(drafted, default=0)
        base_tokens = fixed_tokens + len(auto)
        is_plain = not any(gammas)  # γ 0 for everyone: a plain step, priced as measured
        best = base_tokens / float(cost.plain_seconds(base_batch) if is_plain else
                                   cost.step_seconds(base_batch, fixed_max, base_drafts))
        gains, owners, positions = _all_gains(requests, auto, self.cfg.gamma_max)
        if not len(gains):
            return
        # every gain at once for the least a speculating step costs (one more position,
        # one drafted unless lookups stand in): if that does not clear the hurdle, no plan
        # does, and the search below (most of a step's 0.2-0.5 ms of policy) is skipped
        free = any(requests[i].draft_free for i in auto)
        cheapest = (cost.verify_seconds(base_batch + 1)
                    + cost.draft_seconds(fixed_max if free else max(fixed_max, 1),
                                         base_drafts + (0 if free else 1)))
        hurdle = best * (1 + self.cfg.min_gain + 1e-9)
        if (base_tokens + gains.sum()) / float(cheapest) <= hurdle:
            return
        order = np.argsort(-gains, kind="stable")  # best gains first; positions in order
        gains, owners, positions = gains[order], owners[order], positions[order]
        costly = ~np.array([r.draft_free for r in requests], dtype=bool)[owners]
        # row G: the k best gains among positions < G (largest γ G); [G, k] at once
        tops = np.arange(1, self.cfg.gamma_max + 1)[:, None]
        take = positions[None, :] < tops                       # [G, num_gains]
        # a position's batch tokens: 1 in a chain, a tree level's nodes in a tree (so
        # a hot batch sheds trees' deep levels before speculation turns off)
        level = np.diff([width(g) for g in range(self.cfg.gamma_max + 1)])
        k = np.cumsum(take * level[positions][None, :], axis=1)
        k_drafted = np.cumsum(take & costly[None, :], axis=1)
        tokens = base_tokens + np.cumsum(np.where(take, gains, 0.0), axis=1)
        largest = np.maximum(fixed_max, np.maximum.accumulate(
            np.where(take & costly[None, :], positions + 1, 0), axis=1))
        values = np.where(take, tokens / cost.step_seconds(base_batch + k, largest,
                                                           base_drafts + k_drafted), -np.inf)
        top, at = np.unravel_index(int(values.argmax()), values.shape)
        if values[top, at] > hurdle:
            plan = owners[:at + 1][take[top, :at + 1]]
            for i, g in zip(*np.unique(plan, return_counts=True)):
                gammas[int(i)] = int(g)

    def request_rate(self, heat: float, num_running: int, acceptance: Acceptance) -> float:
        """Expected tokens/s for one more request like this on a replica at `heat` with
        `num_running` requests (assumed alike): what the router ranks replicas by. Reads
        the policy's state, never changes it."""
        batch = [RequestState(acceptance) for _ in range(num_running + 1)]
        gammas = [0] * len(batch)
        if heat < self.cfg.hot_heat:
            self._maximise_goodput(batch, gammas, list(range(len(batch))))
        step = (self.cost.step_seconds(sum(1 + g for g in gammas), max(gammas), sum(gammas))
                if any(gammas) else self.cost.plain_seconds(len(gammas)))
        # the requests are alike, so any of them is the new one: their mean, not the last
        # one's share of the positions the optimum gave out
        tokens = sum(acceptance.expected_tokens(g) for g in gammas) / len(gammas)
        return tokens / float(step)


def _all_gains(requests, auto: list[int], gamma_max: int):
    """Every AUTO request's marginal gains up to min(γ_max, its cap): (expected extra
    tokens, request index, draft position) as parallel arrays, a request's in order."""
    alphas = np.array([_padded(requests[i].acceptance.alphas, gamma_max) for i in auto])
    caps = np.array([min(gamma_max, requests[i].gamma_cap) for i in auto])
    kept = (np.arange(gamma_max)[None, :] < caps[:, None]).ravel()  # [n * γ_max]
    survive = np.cumprod(alphas.reshape(len(auto), gamma_max), axis=1)  # [n, γ_max]
    owners = np.repeat(np.array(auto, dtype=np.int64), gamma_max)
    positions = np.tile(np.arange(gamma_max, dtype=np.int64), len(auto))
    return survive.ravel()[kept], owners[kept], positions[kept]


def _padded(alphas: list[float], width: int) -> list[float]:
    """Acceptance.alpha(j) for j < width: the last estimate repeated, 0 where none."""
    return (alphas + alphas[-1:] * width)[:width] if alphas else [0.0] * width
