"""The OpenAI-compatible request bodies (pydantic) and how they become GenerateRequests.

Fields OpenAI defines that Outrider cannot honour (logprobs, penalties, logit_bias,
suffix, tools) are accepted only at their neutral values, so a client never gets an
answer that silently ignored what it asked for; unknown fields are refused. Outrider's
own options ride along as extensions (send them with the openai package's `extra_body`):
top_k, ignore_eos, stop_token_ids, speculation, gamma, tag, request_id."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from outrider.router.validate import ValidationError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from outrider.client.request import build_request
from outrider.v1 import generate_pb2 as gp

UINT32_MAX = 2**32 - 1
SEED_MAX = 2**63 - 1
MAX_CHOICES = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension; its load client sends 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Outrider extensions
    top_k: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    speculation: Literal["auto", "off", "fixed"] = "auto"
    gamma: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0   # AUTO: the most; FIXED: γ
    tag: str = ""
    request_id: str | None = None

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                     "top_logprobs", "suffix", check_fields=False)
    @classmethod
    def _neutral(cls, value):
        if value:
            raise ValueError("is not supported (only its neutral value)")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _neutral_factor(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("is not supported (only its neutral value, 1.0)")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def generate_requests(self, prompt: str | list[int], max_tokens: int | None,
                          request_id: str | None) -> list[gp.GenerateRequest]:
        """One GenerateRequest per choice; choice i of a seeded request uses seed + i."""
        request_id = self.request_id or request_id
        return [build_request(
            prompt, max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, seed=None if self.seed is None else (self.seed + i) % SEED_MAX,
            stop=self.stops, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            speculation=self.speculation, gamma_max=self.gamma, tag=self.tag,
            request_id=_choice_id(request_id, i, self.n))
            for i in range(self.n)]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | Annotated[list[int], Field(min_length=1)] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: str | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValidationError("prompt: is empty")
        return list(p)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _choice_id(request_id: str | None, i: int, n: int) -> str:
    if not request_id:
        return ""
    return request_id if n == 1 else f"{request_id}.{i}"


# Router validation names GenerateRequest fields; HTTP callers know the OpenAI ones.
HTTP_FIELD = {"sampling.max_tokens": "max_tokens", "sampling.temperature": "temperature",
              "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.seed": "seed",
              "sampling.stop_token_ids": "stop_token_ids", "sampling.stop": "stop",
              "text": "prompt", "token_ids.ids": "prompt", "prompt": "prompt",
              "speculation.gamma_max": "gamma", "speculation.mode": "speculation",
              "request_id": "request_id", "tag": "tag"}
_FIELD_AT_START = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)*)")


def http_field(message: str) -> tuple[str | None, str]:
    """(the OpenAI parameter a message names, the message in OpenAI's terms). Router
    messages start with a GenerateRequest field; body errors with `param: ...`."""
    match = _FIELD_AT_START.match(message)
    if not match:
        return None, message
    name = match.group(1)
    if name in HTTP_FIELD:
        return HTTP_FIELD[name], HTTP_FIELD[name] + message[match.end():]
    return (name if message[match.end():].startswith(":") else None), message
