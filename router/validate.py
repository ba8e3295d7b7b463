"""Public requests -> validated jobs. Every refusal names the field it is about."""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass

from outrider.router.text_stream import TextStream

from outrider.core.grammar import Grammars
from outrider.core.policy import MASK_BITS, MAX_GAMMA, SpecMode
from outrider.core.sampling import MAX_SEED, SamplingError, SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.core.structured import StructuredOutput, StructuredOutputError
from outrider.core.tokenizer import Tokenizer
from outrider.v1 import generate_pb2 as gp

MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_IDS = 1024
MAX_PROMPT_CHARS = 1 << 20
DEFAULT_MAX_TOKENS = 16
NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
TAG_RE = re.compile(r"[A-Za-z0-9_.-]{0,64}")
STRUCTURED_TAG = "+structured"  # constrained requests' statistics (no client tag has a +)
SAMPLED_TAG = "@"  # sampled requests' statistics, by acceptance class (nor an @)


def client_tag(stats_tag: str) -> str:
    """The tag a client gave, of a tag statistics are kept under."""
    return re.split(r"[+@]", stats_tag, maxsplit=1)[0]
MODES = {gp.SPECULATION_MODE_AUTO: SpecMode.AUTO, gp.SPECULATION_MODE_OFF: SpecMode.OFF,
         gp.SPECULATION_MODE_FIXED: SpecMode.FIXED}


class ValidationError(ValueError):
    """An argument the router refuses; the message names the field."""


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # the seed is always set: a resumed request reproduces itself
    stop: tuple[str, ...]
    mode: SpecMode
    gamma_max: int
    tag: str
    include_rounds: bool
    fingerprint: str        # same request id + different fingerprint = a different request
    resume_from: int = 0    # output tokens the client has (a stream resumed, §9.4)
    proposer: str = ""      # ProposerKind ("": the replica's --proposer)
    tree: tuple[int, int] = (0, 0)  # its token tree's (top-k, tokens); 0: the replica's
    include_stop: bool = False  # the text keeps the stop string that ends it
    skip_special_tokens: bool = True  # the text leaves special tokens out

    def text_stream(self, tokenizer: Tokenizer) -> TextStream:
        """The request's detokenisation and stop strings."""
        return TextStream(tokenizer, self.stop, self.include_stop, self.skip_special_tokens)

    @property
    def stats_tag(self) -> str:
        """The tag its acceptance is counted and looked up under: constrained outputs
        apart (a grammar changes what the draft gets right), as `<tag>+structured`, and
        sampled ones by their acceptance class, as `<tag>@t0.7`."""
        tag = self.tag + STRUCTURED_TAG if self.params.structured_output else self.tag
        sampled = self.params.acceptance_class
        return f"{tag}{SAMPLED_TAG}{sampled}" if sampled else tag


def validate(req: gp.GenerateRequest, tokenizer: Tokenizer, max_model_len: int,
             grammars: Grammars, defaults: dict | None = None) -> Job:
    """A request checked and completed; sampling fields it leaves unset take `defaults`
    (the checkpoint's generation_config.json, hf_config.sampling_defaults), else the API's."""
    prompt_ids = _prompt_ids(req, tokenizer)
    params, stop = _sampling(req.sampling, tokenizer.vocab_size, max_model_len, grammars,
                             defaults or {})
    spec = req.speculation
    if spec.mode not in MODES:
        raise ValidationError(f"speculation.mode: unknown value {spec.mode}")
    if spec.gamma_max > MAX_GAMMA:
        raise ValidationError(f"speculation.gamma_max must be <= {MAX_GAMMA}, "
                              f"got {spec.gamma_max}")
    if spec.tree_tokens >= MASK_BITS:
        raise ValidationError(f"speculation.tree_tokens must be below {MASK_BITS}, "
                              f"got {spec.tree_tokens}")
    if spec.tree_topk > MASK_BITS:
        raise ValidationError(f"speculation.tree_topk must be <= {MASK_BITS}, "
                              f"got {spec.tree_topk}")
    if req.request_id and not NAME_RE.fullmatch(req.request_id):
        raise ValidationError("request_id must be 1-128 characters of A-Z a-z 0-9 _ . : -")
    if not TAG_RE.fullmatch(req.tag):
        raise ValidationError("tag must be at most 64 characters of A-Z a-z 0-9 _ . -")
    if req.resume_from and not req.request_id:
        raise ValidationError("resume_from needs the request_id of the stream it resumes")
    if req.proposer:
        try:
            ProposerKind.parse(req.proposer)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
    return Job(req.request_id or uuid.uuid4().hex, tuple(prompt_ids), params, stop,
               MODES[spec.mode], spec.gamma_max, req.tag, req.include_rounds,
               _fingerprint(req), req.resume_from, req.proposer,
               (spec.tree_topk, spec.tree_tokens),
               req.sampling.include_stop_str_in_output, not req.sampling.keep_special_tokens)


def _fingerprint(req: gp.GenerateRequest) -> str:
    """The request's identity: all of it but where a resumed stream picks up."""
    whole = gp.GenerateRequest()
    whole.CopyFrom(req)
    whole.ClearField("resume_from")
    return hashlib.sha256(whole.SerializeToString(deterministic=True)).hexdigest()


def _prompt_ids(req: gp.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt: set either text or token_ids")
    if kind == "text":
        if not req.text:
            raise ValidationError("text is empty")
        if len(req.text) > MAX_PROMPT_CHARS:
            raise ValidationError(f"text has {len(req.text)} characters; the limit is "
                                  f"{MAX_PROMPT_CHARS}")
        return tokenizer.encode(req.text)
    ids = list(req.token_ids.ids)
    if not ids:
        raise ValidationError("token_ids.ids is empty")
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValidationError(f"token_ids.ids holds {bad}, outside the vocabulary [0, {vocab})")
    return ids


def _sampling(s: gp.SamplingOptions, vocab: int, max_model_len: int, grammars: Grammars,
              defaults: dict) -> tuple[SamplingParams, tuple[str, ...]]:
    if len(s.stop) > MAX_STOP_STRINGS:
        raise ValidationError(f"sampling.stop has {len(s.stop)} strings; the limit is "
                              f"{MAX_STOP_STRINGS}")
    if any(not x or len(x) > MAX_STOP_LEN for x in s.stop):
        raise ValidationError(f"sampling.stop strings must be 1-{MAX_STOP_LEN} characters")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
            not 0 <= t < vocab for t in s.stop_token_ids):
        raise ValidationError(f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, "
                              f"each in [0, {vocab})")
    if len(s.logit_bias) > MAX_LOGIT_BIAS_IDS or any(not 0 <= t < vocab for t in s.logit_bias):
        raise ValidationError(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS_IDS} token ids, "
                              f"each in [0, {vocab})")
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens > max_model_len:
        raise ValidationError(f"sampling.max_tokens={max_tokens} exceeds the model's context "
                              f"of {max_model_len} tokens")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(s, "temperature", defaults.get("temperature", 1.0)),
            top_k=_or(s, "top_k", defaults.get("top_k", 0)),
            top_p=_or(s, "top_p", defaults.get("top_p", 1.0)),
            seed=s.seed if s.HasField("seed") else secrets.randbelow(MAX_SEED),
            stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
            min_p=_or(s, "min_p", defaults.get("min_p", 0.0)),
            repetition_penalty=_or(s, "repetition_penalty",
                                   defaults.get("repetition_penalty", 1.0)),
            frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
            logit_bias=tuple(sorted(s.logit_bias.items())), min_tokens=s.min_tokens,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            structured_output=_structured(s, grammars))
    except SamplingError as exc:
        raise ValidationError(f"sampling.{exc}") from None
    return params, tuple(s.stop)


def _structured(s: gp.SamplingOptions, grammars: Grammars) -> StructuredOutput | None:
    """The constraint, compiled here first: one that does not compile never reaches a
    replica (compiling is cached per grammar, and llguidance bounds its work)."""
    try:
        so = StructuredOutput.from_proto(s.structured_output)  # None when not set
        if so is not None:
            grammars.check(so)
    except StructuredOutputError as exc:
        raise ValidationError(f"sampling.{exc}") from None
    return so


def _or(msg, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default

