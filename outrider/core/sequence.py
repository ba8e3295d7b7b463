"""A request's sequence as the target engine runs it, and the records of its rounds.

Torch-free: the scheduler, the replica's service and the engine share these; what the
speculative loop keeps in tensors for a sequence (its drafts made ahead) lives in the
loop's own table (outrider/engine/spec_decode.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

from outrider.core.sampling import SamplingParams, TokenLogprob
from outrider.core.stats import SpecStats

if TYPE_CHECKING:
    from outrider.engine.tree import TreeShape

# (position, the target's k likeliest token ids there, their log-probabilities)
TeacherRow = tuple[int, tuple[int, ...], tuple[float, ...]]


class FinishReason(StrEnum):
    """Why a sequence ended; the value is what the wire and the API say."""

    STOP = "stop"            # an end-of-sequence or stop token
    LENGTH = "length"        # max_tokens, or the model's context
    CANCELLED = "cancelled"  # its caller went away or cancelled it
    ERROR = "error"          # the replica failed it (the detail says why)


# the n-gram lookup's shortest and longest match, by default (engine/lookup.py; here so
# that the flags read them without numpy)
NGRAM_MIN, NGRAM_MAX = 2, 5
NGRAM_SIZES = (NGRAM_MIN, NGRAM_MAX)


class ProposerKind(StrEnum):
    """What proposes a request's draft tokens (docs/DESIGN.md §2.8)."""

    AUTO = "auto"      # per round: a lookup, the draft model, or the lookup continued by it
    MODEL = "model"    # the draft model (draft replicas, or one in process)
    NGRAM = "ngram"    # prompt lookup over the request's own tokens
    SUFFIX = "suffix"  # suffix match over the request and recently served sequences
    # Jacobi guesses from the target's own verification rows, and an n-gram pool of them
    LOOKAHEAD = "lookahead"

    @property
    def is_model_free(self) -> bool:
        return self in (ProposerKind.NGRAM, ProposerKind.SUFFIX, ProposerKind.LOOKAHEAD)

    @classmethod
    def parse(cls, value: str, what: str = "proposer") -> ProposerKind:
        """The kind named `value`; a ValueError naming `what` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {', '.join(k.value for k in cls)}, "
                             f"got {value!r}") from None


class Round(NamedTuple):
    """One speculative round of a sequence: γ proposed, the first `num_accepted` kept; the
    first `num_free` proposals were looked up (`free_kind`), the rest the model's."""

    gamma: int
    num_accepted: int
    free_kind: str = ""
    num_free: int = 0
    tree_nodes: int = 0  # a token tree's nodes verified (γ is its depth); 0: a chain
    cache_rank: int = 0  # its drafts were prepared ahead for this outcome (§2.6); 0: not


class RoundStats(NamedTuple):
    """A round as the replica reports it: with the batch heat it ran at and the version
    of the draft weights that proposed (protos: RoundStats)."""

    gamma: int
    num_accepted: int
    heat: float
    draft_version: int
    free_kind: str = ""  # the first num_free proposals were looked up, the rest drafted
    num_free: int = 0
    model_method: str = ""  # what drafted the rest (Proposer.method; "": draft_model)
    tree_nodes: int = 0     # a token tree's nodes verified (γ: its depth); 0: a chain
    cache_rank: int = 0     # the speculation cache's outcome its drafts came from; 0: none


@dataclass(eq=False)  # a sequence is itself, not its fields: the scheduler's membership
class Sequence:      # tests compared all fields pairwise (3 % of a 32-stream step)
    seq_id: int
    token_ids: list[int]  # prompt + output
    prompt_len: int
    params: SamplingParams
    seed: int
    target_len: int = 0   # positions in the target's KV cache
    draft_len: int = 0    # positions the draft is believed to hold
    finish_reason: FinishReason | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    last_round: Round = Round(0, 0)
    traceparent: str = ""  # W3C trace context of its request, for the draft replica's span
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    num_cached_tokens: int | None = None  # prompt positions the prefix cache gave it, once known
    teacher: list[TeacherRow] = field(default_factory=list)  # top-k rows not yet sent to the draft
    # the target's argmax at its last round's verification rows past the committed tokens
    # (Jacobi's next guesses, engine/lookahead.py), for its next proposal
    guesses: list[int] = field(default_factory=list)
    proposer: str = ""  # its ProposerKind ("": the replica's default)
    # this round's proposer where the γ policy chose it ("": `proposer`): the model for
    # its probe, the suffix lookup for its lookup rounds (§4.4)
    round_proposer: str = ""
    tree: TreeShape | None = None  # its own token tree within the replica's (None: that)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens the target has not computed yet."""
        return len(self.token_ids) - self.target_len

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
