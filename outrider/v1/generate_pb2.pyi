from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_FIXED: _ClassVar[SpeculationMode]
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_FIXED: SpeculationMode

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_tokens", "stop", "stop_token_ids", "seed", "ignore_eos", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "logprobs", "structured_output", "include_stop_str_in_output", "keep_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    structured_output: StructuredOutput
    include_stop_str_in_output: bool
    keep_special_tokens: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., include_stop_str_in_output: _Optional[bool] = ..., keep_special_tokens: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "whitespace_flexible")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_FLEXIBLE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    whitespace_flexible: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., whitespace_flexible: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("mode", "gamma_max", "tree_topk", "tree_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_MAX_FIELD_NUMBER: _ClassVar[int]
    TREE_TOPK_FIELD_NUMBER: _ClassVar[int]
    TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    gamma_max: int
    tree_topk: int
    tree_tokens: int
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., gamma_max: _Optional[int] = ..., tree_topk: _Optional[int] = ..., tree_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "sampling", "speculation", "request_id", "tag", "include_rounds", "resume_from", "proposer", "model")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    sampling: SamplingOptions
    speculation: SpeculationOptions
    request_id: str
    tag: str
    include_rounds: bool
    resume_from: int
    proposer: str
    model: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ..., request_id: _Optional[str] = ..., tag: _Optional[str] = ..., include_rounds: _Optional[bool] = ..., resume_from: _Optional[int] = ..., proposer: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_len", "rounds", "drafted_per_position", "accepted_per_position", "by_proposer")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    BY_PROPOSER_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_len: float
    rounds: int
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    by_proposer: _containers.RepeatedCompositeFieldContainer[ProposerStats]
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_len: _Optional[float] = ..., rounds: _Optional[int] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., by_proposer: _Optional[_Iterable[_Union[ProposerStats, _Mapping]]] = ...) -> None: ...

class ProposerStats(_message.Message):
    __slots__ = ("method", "draft_tokens", "accepted_tokens")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    method: str
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, method: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("gamma", "num_accepted", "heat", "draft_version", "free_kind", "num_free", "model_method", "tree_nodes", "cache_rank")
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FREE_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_FIELD_NUMBER: _ClassVar[int]
    MODEL_METHOD_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_RANK_FIELD_NUMBER: _ClassVar[int]
    gamma: int
    num_accepted: int
    heat: float
    draft_version: int
    free_kind: str
    num_free: int
    model_method: str
    tree_nodes: int
    cache_rank: int
    def __init__(self, gamma: _Optional[int] = ..., num_accepted: _Optional[int] = ..., heat: _Optional[float] = ..., draft_version: _Optional[int] = ..., free_kind: _Optional[str] = ..., num_free: _Optional[int] = ..., model_method: _Optional[str] = ..., tree_nodes: _Optional[int] = ..., cache_rank: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "speculation", "rounds", "replica", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    rounds: _containers.RepeatedCompositeFieldContainer[Round]
    replica: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., rounds: _Optional[_Iterable[_Union[Round, _Mapping]]] = ..., replica: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: str
    def __init__(self, tag: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("address", "model_pair", "heat", "num_running", "num_waiting", "kv_used_blocks", "kv_total_blocks", "tokens_per_s", "age_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PAIR_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    model_pair: str
    heat: float
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    tokens_per_s: float
    age_s: float
    def __init__(self, address: _Optional[str] = ..., model_pair: _Optional[str] = ..., heat: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., age_s: _Optional[float] = ...) -> None: ...

class AcceptanceStats(_message.Message):
    __slots__ = ("model_pair", "tag", "tested_per_position", "accepted_per_position")
    MODEL_PAIR_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    TESTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    model_pair: str
    tag: str
    tested_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_pair: _Optional[str] = ..., tag: _Optional[str] = ..., tested_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("replicas", "acceptance", "is_store_reachable")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    IS_STORE_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    acceptance: _containers.RepeatedCompositeFieldContainer[AcceptanceStats]
    is_store_reachable: bool
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., acceptance: _Optional[_Iterable[_Union[AcceptanceStats, _Mapping]]] = ..., is_store_reachable: _Optional[bool] = ...) -> None: ...
