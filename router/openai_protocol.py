"""The OpenAI-compatible request bodies (pydantic) and how they become GenerateRequests.

Fields OpenAI defines that Outrider cannot honour (suffix, best_of > 1, echo together
with logprobs) are accepted only at their neutral values, so a client never gets an
answer that silently ignored what it asked for; unknown fields are refused. vLLM's
sampling extensions and Outrider's own options ride along (send them with the openai
package's `extra_body`): top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, speculation, gamma, tag, request_id, proposer, and vLLM's
structured_outputs (OpenAI's response_format is honoured too)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from outrider.router.validate import ValidationError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from outrider.client.request import build_request
from outrider.core.sequence import ProposerKind
from outrider.v1 import generate_pb2 as gp

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
MAX_CHOICES = 16
MAX_LOGPROBS = 20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class BodyFieldError(ValueError):
    """A body field no request may carry, whatever its type; `field` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _only_valid_unicode(cls, data):
        """JSON may escape a lone surrogate (\\udfff): no tokenizer or protobuf takes it."""
        field = _lone_surrogate_at(data)
        if field is not None:
            raise BodyFieldError(field, "is not valid Unicode text (it holds a lone "
                                        "surrogate); send UTF-8")
        return data


def _lone_surrogate_at(value, path: str = "") -> str | None:
    """The path of the first string holding a lone surrogate (None: there is none)."""
    if isinstance(value, str):
        return None if value.isascii() or _is_encodable(value) else (path or "body")
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        if isinstance(key, str) and not _is_encodable(key):
            return path or "body"
        found = _lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _is_encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is needed with type json_schema, and only then")
        return self

    def constraint(self) -> dict:
        if self.type == "json_schema":
            return {"json_schema": self.json_schema.schema_}
        return {"json_object": True} if self.type == "json_object" else {}


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra body: one constraint."""

    json_: dict | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None  # JSON; unset: Outrider's default (compact)

    @model_validator(mode="after")
    def _exactly_one(self):
        if len(self._given()) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, "
                             f"grammar (got {len(self._given())})")
        return self

    def _given(self) -> dict:
        given = {"json_schema": self.json_, "json_object": self.json_object or None,
                 "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        return {k: v for k, v in given.items() if v is not None}

    def constraint(self) -> dict:
        whitespace = {"whitespace_flexible": True} if self.disable_any_whitespace is False else {}
        return {**self._given(), **whitespace}


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # vLLM's older names of structured_outputs' fields


class _GenerationRequest(_Strict):
    """A top-level body: fields it does not know are kept aside (`ignored_fields`), not
    refused, as OpenAI clients send extras other servers take; nested objects stay
    strict. The router refuses them instead under --strict-openai-fields."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    # vLLM's sampling extensions
    top_k: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Outrider extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    speculation: Literal["auto", "off", "fixed"] = "auto"
    gamma: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0   # AUTO: the most; FIXED: γ
    tag: str = ""
    request_id: str | None = None
    proposer: ProposerKind | None = None  # an extra field: what proposes (§2.8)
    # extra fields: its token tree within the replica's (§8.9; 1: chains, 0: the replica's)
    tree_topk: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    tree_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    # structured outputs (§3.8): OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data):
        """guided_json and its kin as the structured_outputs they name."""
        if not isinstance(data, dict) or not GUIDED.keys() & data.keys():
            return data
        given = {k: data[k] for k in GUIDED if k in data}
        if len(given) > 1 or "structured_outputs" in data or "response_format" in data:
            raise BodyFieldError(next(iter(given)), "give one constraint: one guided_* "
                                 "field, structured_outputs or response_format")
        (name, value), = given.items()
        rest = {k: v for k, v in data.items() if k != name}
        return rest | {"structured_outputs": {GUIDED[name]: value}}

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.response_format is not None and self.structured_outputs is not None:
            raise BodyFieldError("structured_outputs", "give it or response_format, not both")
        return self

    @property
    def constraint(self) -> dict:
        """build_request's constraint options."""
        for given in (self.response_format, self.structured_outputs):
            if given is not None:
                return given.constraint()
        return {}

    @field_validator("suffix", check_fields=False)
    @classmethod
    def _neutral(cls, value):
        if value:
            raise ValueError("is not supported (only its neutral value)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise ValueError(f"key {key!r} is not a token id")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to return (None: no logprobs)."""
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def generate_requests(self, prompt: str | list[int], max_tokens: int | None,
                          request_id: str | None) -> list[gp.GenerateRequest]:
        """One GenerateRequest per choice; choice i of a seeded request uses seed + i."""
        request_id = self.request_id or request_id
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        return [build_request(
            prompt, max_tokens=max_tokens, temperature=self.temperature,
            top_k=max(self.top_k, 0) if self.top_k is not None else None, top_p=self.top_p,
            min_p=self.min_p, seed=None if self.seed is None else (self.seed + i) % SEED_MAX,
            stop=self.stops, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            logit_bias=bias, logprobs=self.num_logprobs, speculation=self.speculation,
            gamma_max=self.gamma, tag=self.tag, request_id=_choice_id(request_id, i, self.n),
            proposer=self.proposer.value if self.proposer else "",
            tree_topk=self.tree_topk, tree_tokens=self.tree_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, **self.constraint)
            for i in range(self.n)]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | Annotated[list[int], Field(min_length=1)] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _not_with_echo(cls, value: int | None, info) -> int | None:
        if value is not None and info.data.get("echo"):
            raise ValueError("together with echo needs the prompt's logprobs, which are "
                             "not supported: drop one of them")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValidationError("prompt: is empty")
        return list(p)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; unset: any object
    strict: bool | None = None      # a forced call's arguments always keep to it


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # a streamed call's place: clients may send it back


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None           # a tool's answer: to which call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """As chat templates read a message (Hugging Face's convention: a call's
        arguments as an object where they are JSON)."""
        out = self.model_dump(exclude_none=True) | {"content": self.text()}
        for call in out.get("tool_calls", []):
            call["function"]["arguments"] = _json_or_text(call["function"]["arguments"])
        return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (JSON nested deeper than Python recurses)
        return text


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # for the template (enable_thinking)
    # tool calls a request forces ("required" or a named function) are structured
    # outputs (§3.8); "auto" reads calls from the text by the router's --tool-call-parser
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_possible(self):
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if not names:
            if choice not in (None, "none"):
                raise BodyFieldError("tool_choice", "needs tools to choose from")
            return self
        if len(set(names)) < len(names):
            raise BodyFieldError("tools", "name a function twice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise BodyFieldError("tool_choice", f"names function {choice.function.name!r}, "
                                 "which tools do not hold")
        if self.forced_call is not None and super().constraint:
            raise BodyFieldError("tool_choice", "forces a tool call, whose JSON is the "
                                 "output's constraint: drop response_format / "
                                 "structured_outputs")
        if self.forced_call is not None and (self.stops or self.stop_token_ids):
            raise BodyFieldError("stop", "would cut the JSON of the tool call that "
                                 "tool_choice forces: drop stop / stop_token_ids")
        return self

    @property
    def forced_call(self) -> str | None:
        """The function a request forces, "" for any of its tools ('required'), None
        when it forces none."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @property
    def chooses_calls(self) -> bool:
        """Tools offered with tool_choice "auto" (the default with tools): the model
        decides, in its own call format."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model ('none': none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def constraint(self) -> dict:
        forced = self.forced_call
        if forced is None:
            return super().constraint
        parameters = {t.function.name: t.function.parameters or {"type": "object"}
                      for t in self.tools}
        if forced:
            return {"json_schema": parameters[forced]}
        return {"json_schema": _calls_schema(parameters, self.parallel_tool_calls is False)}


    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _calls_schema(parameters: dict[str, dict], one: bool) -> dict:
    """A list (of one, or at least one) of {"name", "parameters"} calls, an alternative
    per function. Each function's definitions move to the root, named after it, since
    its `$ref`s point from the root (`#/$defs/x` -> `#/$defs/<function>.x`)."""
    definitions, alternatives = {}, []
    for name, schema in parameters.items():
        schema, moved = _hoisted(schema, name)
        definitions |= moved
        alternatives.append({"type": "object", "additionalProperties": False,
                             "required": ["name", "parameters"],
                             "properties": {"name": {"const": name}, "parameters": schema}})
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    return calls | ({"maxItems": 1} if one else {}) | (
        {"$defs": definitions} if definitions else {})


def _hoisted(schema: dict, name: str) -> tuple[dict, dict]:
    """(the schema without its definitions, its definitions named `<name>.<key>`), its
    references rewritten to match."""
    own = {**schema.get("$defs", {}), **schema.get("definitions", {})}
    if not own:
        return schema, {}
    rest = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    rename = lambda value: _renamed_refs(value, name)  # noqa: E731
    return rename(rest), {f"{name}.{key}": rename(value) for key, value in own.items()}


def _renamed_refs(value, name: str):
    if isinstance(value, list):
        return [_renamed_refs(v, name) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _renamed_refs(v, name) for k, v in value.items()}
    ref = value.get("$ref")
    for prefix in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(prefix):
            out["$ref"] = f"#/$defs/{name}.{ref.removeprefix(prefix)}"
    return out


def _choice_id(request_id: str | None, i: int, n: int) -> str:
    if not request_id:
        return ""
    return request_id if n == 1 else f"{request_id}.{i}"


# Router validation names GenerateRequest fields; HTTP callers know the OpenAI ones.
HTTP_FIELD = {"sampling.max_tokens": "max_tokens", "sampling.temperature": "temperature",
              "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.seed": "seed",
              "sampling.min_p": "min_p", "sampling.min_tokens": "min_tokens",
              "sampling.repetition_penalty": "repetition_penalty",
              "sampling.frequency_penalty": "frequency_penalty",
              "sampling.presence_penalty": "presence_penalty",
              "sampling.logit_bias": "logit_bias", "sampling.logprobs": "logprobs",
              "sampling.stop_token_ids": "stop_token_ids", "sampling.stop": "stop",
              "text": "prompt", "token_ids.ids": "prompt", "prompt": "prompt",
              "speculation.gamma_max": "gamma", "speculation.mode": "speculation",
              "request_id": "request_id", "tag": "tag", "proposer": "proposer",
              "speculation.tree_topk": "tree_topk", "speculation.tree_tokens": "tree_tokens",
              "tree_topk": "tree_topk",  # (the replica's refusal of a shape)
              **{f"sampling.structured_output.{kind}": param for kind, param in (
                  ("json_schema", "response_format"), ("json_object", "response_format"),
                  ("regex", "structured_outputs"), ("choice", "structured_outputs"),
                  ("grammar", "structured_outputs"))}}
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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt's token ids under the served model's tokenizer."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's (BOS and the like), as prompts get


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
