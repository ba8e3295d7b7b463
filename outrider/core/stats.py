"""Acceptance statistics, one type from a single round to a whole fleet.

`AcceptanceCounts` are the per-position counts routers share (per model pair and
workload tag) and the γ policy learns from: for each draft position j, how often a draft
token there was *tested* (every earlier one of its round accepted) and how often it was
accepted. `SpecStats` is a request's or a replica's speculation: those counts, how many
tokens were drafted at each position, and the totals; it records rounds, merges, and
becomes the public `SpeculationStats` message."""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.v1 import generate_pb2 as gp

MODEL_METHOD = "draft_model"  # the draft model's name among the proposers (vLLM's)
CROSS_VOCAB_METHOD = "cross_vocab"  # ... a draft model of another tokenizer (cross_vocab.py)
DRAFT_MODEL_METHODS = (MODEL_METHOD, CROSS_VOCAB_METHOD)  # a draft model's, of either kind
HEAD_METHODS = {"eagle3": "eagle3", "eagle1": "eagle", "medusa": "medusa"}  # vLLM's names
GRAMMAR_METHOD = "grammar"  # tokens a request's grammar forces, proposed for free (§3.8)
PRIOR_ALPHA = 0.7  # acceptance believed where little or nothing was measured


def _add(total: list[int], values: list[int]) -> None:
    total += [0] * (len(values) - len(total))
    for j, v in enumerate(values):
        total[j] += v


def by_proposer(gamma: int, num_accepted: int, free_kind: str, num_free: int,
                model_method: str = "") -> dict[str, tuple[int, int]]:
    """A round's (proposed, accepted) per proposer: its first `num_free` proposals were
    looked up (`free_kind`), the rest drafted by the model (`model_method`: a head's
    kind, or the draft model); acceptance stops at the first rejection, so the
    looked-up part is accepted first."""
    out = {}
    if num_free:
        out[free_kind] = (num_free, min(num_accepted, num_free))
    if gamma > num_free:
        out[model_method or MODEL_METHOD] = (gamma - num_free, max(0, num_accepted - num_free))
    return out


def model_part(gamma: int, num_accepted: int, num_free: int) -> tuple[int, int] | None:
    """A round's (γ, accepted) as the draft model saw them when its first `num_free`
    proposals were looked up: its drafts follow theirs, so they were tested only when
    every looked-up token was kept. None: the model's part was never tested, or empty."""
    if not num_free:
        return gamma, num_accepted
    if num_accepted < num_free or gamma == num_free:
        return None
    return gamma - num_free, num_accepted - num_free


@dataclass
class AcceptanceCounts:
    tested: list[int]
    accepted: list[int]

    def add_round(self, gamma: int, num_accepted: int) -> None:
        reached = min(gamma, num_accepted + 1)  # positions tested: up to the first rejection
        self.merge(AcceptanceCounts([1] * reached, [int(j < num_accepted) for j in range(reached)]))

    def merge(self, other: AcceptanceCounts) -> None:
        _add(self.tested, other.tested)
        _add(self.accepted, other.accepted)

    def alphas(self, prior: float = PRIOR_ALPHA, prior_weight: float = 4.0) -> list[float]:
        """P(position j accepted | positions < j accepted), shrunk towards `prior` where
        data is thin."""
        return [(a + prior * prior_weight) / (t + prior_weight)
                for t, a in zip(self.tested, self.accepted)]

    def copy(self) -> AcceptanceCounts:
        return AcceptanceCounts(list(self.tested), list(self.accepted))


@dataclass
class SpecStats:
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    counts: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts([], []))
    # the totals per proposer ("draft_model", a head's method, "layer_skip", "cross_vocab",
    # "ngram", "suffix", "lookahead", "grammar"): [drafted, accepted]
    by_proposer: dict[str, list[int]] = field(default_factory=dict)

    def record(self, num_draft: int, num_accepted: int, free_kind: str = "",
               num_free: int = 0, model_method: str = "") -> None:
        """One round: `num_draft` tokens proposed (γ), the first `num_accepted` accepted;
        the first `num_free` of them were looked up (`free_kind`), the rest drafted by
        the model (`model_method`, "": the draft model)."""
        for method, totals in by_proposer(num_draft, num_accepted, free_kind, num_free,
                                          model_method).items():
            _add(self.by_proposer.setdefault(method, [0, 0]), list(totals))
        self.num_rounds += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        _add(self.drafted_per_position, [1] * num_draft)
        _add(self.accepted_per_position, [int(j < num_accepted) for j in range(num_draft)])
        modelled = model_part(num_draft, num_accepted, num_free)
        if modelled:  # the γ policy sizes the draft model's γ from these (§2.8)
            self.counts.add_round(*modelled)

    def merge(self, other: SpecStats) -> None:
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        _add(self.drafted_per_position, other.drafted_per_position)
        _add(self.accepted_per_position, other.accepted_per_position)
        self.counts.merge(other.counts)
        for method, totals in other.by_proposer.items():
            _add(self.by_proposer.setdefault(method, [0, 0]), totals)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per round: accepted draft tokens + the recovered/bonus token."""
        if not self.num_rounds:
            return 0.0
        return (self.num_accepted_tokens + self.num_rounds) / self.num_rounds

    def to_proto(self) -> gp.SpeculationStats:
        return gp.SpeculationStats(
            draft_tokens=self.num_draft_tokens, accepted_tokens=self.num_accepted_tokens,
            acceptance_rate=self.acceptance_rate, mean_accepted_len=self.mean_accepted_len,
            rounds=self.num_rounds, drafted_per_position=self.drafted_per_position,
            accepted_per_position=self.accepted_per_position,
            by_proposer=[gp.ProposerStats(method=m, draft_tokens=d, accepted_tokens=a)
                         for m, (d, a) in sorted(self.by_proposer.items())])

    @classmethod
    def from_proto(cls, msg: gp.SpeculationStats) -> SpecStats:
        """The totals and per-position figures of a message (it carries no tested counts)."""
        return cls(msg.rounds, msg.draft_tokens, msg.accepted_tokens,
                   list(msg.drafted_per_position), list(msg.accepted_per_position),
                   by_proposer={p.method: [p.draft_tokens, p.accepted_tokens]
                                for p in msg.by_proposer})
