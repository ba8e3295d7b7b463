"""The γ policy (DESIGN §4): how many tokens to speculate, per request and per round.

Pure Python, no torch: the router uses it to admit and route, and the target's scheduler
calls the same code every round. It maximises the expected goodput of the whole batch —
tokens per second over all running requests — from
  * batch heat (0 = idle, 1 = the step's token budget is full without speculation),
  * each request's per-position acceptance estimate (EWMA, warm-started from shared
    statistics for its model pair and workload tag),
  * a cost model measured on the replica (verify time vs batch tokens, draft time per
    drafted position, draft round trip).
Speculation is switched off when the batch is hot and back on when it cools, with
hysteresis; per-request overrides (OFF, FIXED γ) always win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

MAX_GAMMA = 16  # the most draft tokens a request may ask for per round


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

    def __post_init__(self) -> None:
        if min(self.verify_base_s, self.verify_per_token_s, self.draft_per_position_s,
               self.draft_rtt_s) < 0:
            raise ValueError("cost model times must be >= 0")

    def step_seconds(self, batch_tokens: int, max_gamma: int) -> float:
        draft = max_gamma * self.draft_per_position_s + self.draft_rtt_s if max_gamma else 0.0
        extra_tokens = max(0, batch_tokens - self.knee_tokens)
        return self.verify_base_s + self.verify_per_token_s * extra_tokens + draft


@dataclass(frozen=True)
class PolicyConfig:
    gamma_max: int = 8
    hot_heat: float = 0.9    # speculation off at or above this heat ...
    cool_heat: float = 0.7   # ... and back on at or below this one
    ewma_weight: float = 0.1  # weight of the newest round in the acceptance estimate

    def __post_init__(self) -> None:
        if self.gamma_max < 0:
            raise ValueError("gamma_max must be >= 0")
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


@dataclass
class GammaPolicy:
    cfg: PolicyConfig
    cost: CostModel
    is_speculating: bool = True
    history: list[tuple[float, int]] = field(default_factory=list)  # (heat, mean γ)

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
        auto = [i for i, r in enumerate(requests) if r.mode is SpecMode.AUTO]
        if speculating and auto:
            self._maximise_goodput(requests, gammas, auto)
        if requests:
            self.history.append((heat, sum(gammas) / len(gammas)))
            del self.history[:-1000]
        return gammas

    def _override(self, r: RequestState) -> int:
        if r.mode is SpecMode.FIXED:
            return max(0, min(r.fixed_gamma, r.gamma_cap))
        return 0

    def _maximise_goodput(self, requests, gammas: list[int], auto: list[int]) -> None:
        """Exact maximum of batch goodput over the AUTO requests' γ.

        For a given largest γ G (which sets the draft's time), adding draft position j
        to request i adds P(positions 0..j all accepted) expected tokens and one batch
        token; those marginal gains fall along j, so for G and a number k of added
        positions the best choice is the k largest gains. Enumerating (G, k) costs
        O(G_max · n log n) instead of a search over all γ vectors."""
        is_auto = set(auto)
        fixed_tokens = sum(r.acceptance.expected_tokens(gammas[i])
                           for i, r in enumerate(requests) if i not in is_auto)
        base_batch = sum(1 + g for g in gammas)  # AUTO rows start at γ = 0
        fixed_max = max(gammas, default=0)
        best = (fixed_tokens + len(auto)) / self.cost.step_seconds(base_batch, fixed_max)
        best_plan: dict[int, int] = {}
        for top in range(1, self.cfg.gamma_max + 1):
            gains = sorted(((gain, i) for i in auto
                            for gain in _marginal_gains(requests[i], top)), reverse=True)
            tokens, counts = fixed_tokens + len(auto), {}
            for k, (gain, i) in enumerate(gains, start=1):
                tokens += gain
                counts[i] = counts.get(i, 0) + 1
                value = tokens / self.cost.step_seconds(base_batch + k,
                                                        max(fixed_max, max(counts.values())))
                if value > best * (1 + 1e-9):
                    best, best_plan = value, dict(counts)
        for i, g in best_plan.items():
            gammas[i] = g

    def request_rate(self, heat: float, num_running: int, acceptance: Acceptance) -> float:
        """Expected tokens/s for one more request like this on a replica at `heat` with
        `num_running` requests (assumed alike): what the router ranks replicas by. Reads
        the policy's state, never changes it."""
        batch = [RequestState(acceptance) for _ in range(num_running + 1)]
        gammas = [0] * len(batch)
        if heat < self.cfg.hot_heat:
            self._maximise_goodput(batch, gammas, list(range(len(batch))))
        gamma = max(gammas)
        step = self.cost.step_seconds(sum(1 + g for g in gammas), gamma)
        return acceptance.expected_tokens(gammas[-1]) / step


def _marginal_gains(request: RequestState, top: int) -> list[float]:
    """Expected extra tokens from each draft position up to min(top, cap)."""
    gains, survive = [], 1.0
    for j in range(min(top, request.gamma_cap)):
        survive *= request.acceptance.alpha(j)
        gains.append(survive)
    return gains
