"""Sampling parameters: what a request asks of the sampler, validated, and how it
travels (protos/outrider/v1). Torch-free: the router validates with it, the SDK's
requests become it, the target's and the draft's engines run it
(outrider/engine/sampling.py applies it to logits)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outrider.core.structured import StructuredOutput, StructuredOutputError
from outrider.v1 import generate_pb2 as gp
from outrider.v1 import worker_pb2 as pb

if TYPE_CHECKING:  # the SDK imports this module and installs without numpy
    import numpy as np

MAX_SEED = 2**63 - 1
GREEDY_BELOW = 1e-5  # temperatures this small are greedy: logits / T would overflow
MAX_CLASS_TEMPERATURE = 2.0  # hotter requests share one acceptance class
MAX_LOGPROBS = 20    # alternatives per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0    # |frequency_penalty|, |presence_penalty| (OpenAI's range)


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no top-k truncation
    top_p: float = 1.0        # 1 = no nucleus truncation
    seed: int | None = None   # None: the engine draws one per request
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0        # drop tokens less likely than min_p x the likeliest
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output
    frequency_penalty: float = 0.0   # subtracted x each earlier occurrence in the output
    presence_penalty: float = 0.0    # subtracted once if the token is in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0       # EOS and stop_token_ids are held back until this many
    logprobs: int | None = None  # None: none; k: the chosen token's and the k likeliest
    eos_token_ids: tuple[int, ...] = ()  # the model's, set by the engine (min_tokens)
    structured_output: StructuredOutput | None = None  # the grammar the output must match

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, "
                                f"got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise SamplingError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        self._check_processors()

    def _check_processors(self) -> None:
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingError(f"repetition_penalty must be a finite number > 0 "
                                f"(1 disables), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or abs(value) > MAX_PENALTY:
                raise SamplingError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                    f"got {value!r}")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise SamplingError(f"logit_bias: token id {token!r} is not an id")
            if not _is_real(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, "
                                    f"{MAX_LOGIT_BIAS:g}], got {bias!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens must be an integer in [0, max_tokens="
                                f"{self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                                f"got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def acceptance_class(self) -> str:
        """Which requests share an acceptance estimate (docs/DESIGN.md §4.1): how often a
        draft token passes depends on the temperature it is sampled at (the first demo
        draft kept 0.94 of its tokens greedy, 0.24 at T 0.7), so greedy requests and sampled
        ones, by temperature to a tenth, learn apart; "" for greedy, "t0.7" else."""
        if self.is_greedy:
            return ""
        return f"t{min(self.temperature, MAX_CLASS_TEMPERATURE):.1f}"

    @property
    def reads_history(self) -> bool:
        """Whether the processed logits depend on the tokens before the row."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0
                or self.presence_penalty != 0 or self.min_tokens > 0
                or self.structured_output is not None)

    @property
    def changes_logits(self) -> bool:
        """Whether any processor runs before temperature (greedy argmax included)."""
        return self.reads_history or bool(self.logit_bias)

    @property
    def truncates(self) -> bool:
        return bool(self.top_k) or self.top_p < 1 or self.min_p > 0

    @property
    def held_back_ids(self) -> tuple[int, ...]:
        """The tokens that end an output: the stop tokens and, unless ignored, EOS
        (min_tokens holds them back; a draft row stops after one)."""
        eos = () if self.ignore_eos else self.eos_token_ids
        return tuple(sorted({*self.stop_token_ids, *eos}))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class History:
    """The tokens before one logits row, for the processors that read them."""

    token_ids: Sequence[int]  # prompt + committed output (shared by a sequence's rows)
    prompt_len: int
    drafted: tuple[int, ...] = ()  # then the round's draft tokens before this row
    allowed: np.ndarray | None = None  # [words] int32: the grammar's next tokens (§3.8)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len + len(self.drafted)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the processed distribution, and the
    likeliest tokens' (as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_proto(cls, msg: gp.TokenLogprob) -> TokenLogprob:
        return cls(msg.token_id, msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs)))


def sampling_to_proto(params: SamplingParams, seed: int | None) -> pb.Sampling:
    return pb.Sampling(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        held_back_ids=params.held_back_ids,
        structured_output=(params.structured_output.to_proto()
                           if params.structured_output is not None else None))


def sampling_from_proto(msg: pb.Sampling, **fields) -> tuple[SamplingParams, int | None]:
    """SamplingParams (validated: raises SamplingError naming the field) and the seed
    (None when the sender left it unset). Without stop_token_ids in `fields` (a draft
    replica), the held-back ids stand in for them: they are what ends the output, which
    the draft needs for min_tokens and to stop drafting a row."""
    seed = msg.seed if msg.HasField("seed") else None
    if "stop_token_ids" not in fields:  # a draft replica: it never stops a sequence
        fields.update(stop_token_ids=tuple(msg.held_back_ids),
                      max_tokens=max(SamplingParams.max_tokens, msg.min_tokens))
    try:
        structured = StructuredOutput.from_proto(msg.structured_output)
    except StructuredOutputError as exc:
        raise SamplingError(str(exc)) from None
    params = SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0, seed=seed,
        min_p=msg.min_p, repetition_penalty=msg.repetition_penalty or 1.0,
        frequency_penalty=msg.frequency_penalty, presence_penalty=msg.presence_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())), min_tokens=msg.min_tokens,
        structured_output=structured, **fields)
    return params, seed


def logprobs_to_proto(logprobs: list[TokenLogprob]) -> list[gp.TokenLogprob]:
    return [gp.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in logprobs]
