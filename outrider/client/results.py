"""Typed results of a generation, built from the router's messages as they arrive."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from outrider.core.sampling import TokenLogprob as Logprob  # the SDK's name for it
from outrider.core.stats import MODEL_METHOD
from outrider.v1 import generate_pb2 as gp


@dataclass(frozen=True)
class Round:
    gamma: int            # draft tokens proposed
    num_accepted: int
    heat: float           # the replica's batch heat when γ was chosen
    draft_version: int = 0  # the draft weights' version that drafted (online distillation)
    # the first num_free were looked up ("ngram", "suffix", "lookahead") or forced by the grammar
    free_kind: str = ""   # ("grammar"), the rest drafted by the model:
    num_free: int = 0
    model_method: str = "draft_model"  # a draft model, or "eagle3", "eagle", "medusa" (a
    #                                    head), "layer_skip", "cross_vocab"
    tree_nodes: int = 0   # a token tree's nodes verified (gamma: its depth); 0: a chain
    cache_rank: int = 0   # its drafts came ready from the speculation cache (its n-th
    #                       likeliest outcome); 0: drafted when asked


@dataclass(frozen=True)
class Delta:
    """One streamed message: the new text and the token ids behind it."""

    text: str
    token_ids: tuple[int, ...]
    replica: str                   # the target replica generating now
    rounds: tuple[Round, ...] = ()  # with include_rounds=True
    logprobs: tuple[Logprob, ...] = ()  # one per token id, with logprobs=k


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens the replica's prefix cache held

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class SpeculationStats:
    draft_tokens: int
    accepted_tokens: int
    rounds: int
    acceptance_rate: float          # accepted / draft tokens
    mean_accepted_len: float        # tokens per round (accepted + 1)
    drafted_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    # method ("draft_model", "ngram", "suffix", "lookahead", "grammar", a head's, ...)
    # -> (draft tokens, accepted tokens)
    by_proposer: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_proto(cls, s: gp.SpeculationStats) -> SpeculationStats:
        return cls(s.draft_tokens, s.accepted_tokens, s.rounds, s.acceptance_rate,
                   s.mean_accepted_len, tuple(s.drafted_per_position),
                   tuple(s.accepted_per_position),
                   {p.method: (p.draft_tokens, p.accepted_tokens) for p in s.by_proposer})


@dataclass(frozen=True)
class Timings:
    """As this client saw them."""

    ttft_s: float           # call to first token
    total_s: float          # call to last message
    inter_token_s: float    # mean time per token after the first (0 for one token)
    tokens_per_s: float     # completion tokens / total_s


@dataclass(frozen=True)
class Generation:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str        # "stop" or "length"
    usage: Usage
    speculation: SpeculationStats
    timings: Timings
    replica: str              # the replica that finished it
    rounds: tuple[Round, ...] = ()
    logprobs: tuple[Logprob, ...] = ()  # one per token id, with logprobs=k

    def to_dict(self) -> dict:
        """JSON-ready, as `outrider generate --json` prints it."""
        out = dataclasses.asdict(self)
        out["usage"]["total_tokens"] = self.usage.total_tokens
        return out


class Collector:
    """Turns a stream's messages into Deltas and, at the end, one Generation."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.rounds: list[Round] = []
        self.logprobs: list[Logprob] = []
        self.last = gp.GenerateResponse()

    def add(self, msg: gp.GenerateResponse) -> Delta:
        if msg.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        rounds = tuple(Round(r.gamma, r.num_accepted, r.heat, r.draft_version, r.free_kind,
                             r.num_free, r.model_method or MODEL_METHOD, r.tree_nodes,
                             r.cache_rank)
                       for r in msg.rounds)
        self.parts.append(msg.text)
        self.token_ids.extend(msg.token_ids)
        self.rounds.extend(rounds)
        logprobs = tuple(Logprob.from_proto(lp) for lp in msg.logprobs)
        self.logprobs.extend(logprobs)
        self.last = msg
        return Delta(msg.text, tuple(msg.token_ids), msg.replica, rounds, logprobs)

    def result(self) -> Generation:
        end = time.perf_counter()
        first = self.first_token_at or end
        n = len(self.token_ids)
        last = self.last
        return Generation(
            request_id=last.request_id, text="".join(self.parts),
            token_ids=tuple(self.token_ids), finish_reason=last.finish_reason,
            usage=Usage(last.usage.prompt_tokens, last.usage.completion_tokens,
                        last.usage.cached_prompt_tokens),
            speculation=SpeculationStats.from_proto(last.speculation),
            timings=Timings(first - self.started, end - self.started,
                            (end - first) / (n - 1) if n > 1 else 0.0,
                            n / (end - self.started) if end > self.started else 0.0),
            replica=last.replica, rounds=tuple(self.rounds), logprobs=tuple(self.logprobs))
