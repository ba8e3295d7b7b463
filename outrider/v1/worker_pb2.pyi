from outrider.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Q_FORMAT_UNSPECIFIED: _ClassVar[QFormat]
    Q_FORMAT_IDS: _ClassVar[QFormat]
    Q_FORMAT_POINT_MASS: _ClassVar[QFormat]
    Q_FORMAT_SPARSE: _ClassVar[QFormat]
    Q_FORMAT_DENSE_FP16: _ClassVar[QFormat]
    Q_FORMAT_DENSE_DIST: _ClassVar[QFormat]

class FeatureDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_DTYPE_UNSPECIFIED: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_FP32: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_BF16: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_FP16: _ClassVar[FeatureDtype]

class SpecMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_MODE_AUTO: _ClassVar[SpecMode]
    SPEC_MODE_OFF: _ClassVar[SpecMode]
    SPEC_MODE_FIXED: _ClassVar[SpecMode]
Q_FORMAT_UNSPECIFIED: QFormat
Q_FORMAT_IDS: QFormat
Q_FORMAT_POINT_MASS: QFormat
Q_FORMAT_SPARSE: QFormat
Q_FORMAT_DENSE_FP16: QFormat
Q_FORMAT_DENSE_DIST: QFormat
FEATURE_DTYPE_UNSPECIFIED: FeatureDtype
FEATURE_DTYPE_FP32: FeatureDtype
FEATURE_DTYPE_BF16: FeatureDtype
FEATURE_DTYPE_FP16: FeatureDtype
SPEC_MODE_AUTO: SpecMode
SPEC_MODE_OFF: SpecMode
SPEC_MODE_FIXED: SpecMode

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "held_back_ids", "structured_output")
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
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_BACK_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    held_back_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_output: _generate_pb2.StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., held_back_ids: _Optional[_Iterable[int]] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class ProposeSequence(_message.Message):
    __slots__ = ("seq_id", "committed_len", "new_token_ids", "gamma", "sampling", "q_format", "traceparent", "prefill_only", "prompt_len", "teacher", "features", "ready_only", "unprepared", "deliver")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    Q_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    READY_ONLY_FIELD_NUMBER: _ClassVar[int]
    UNPREPARED_FIELD_NUMBER: _ClassVar[int]
    DELIVER_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    committed_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    gamma: int
    sampling: Sampling
    q_format: QFormat
    traceparent: str
    prefill_only: bool
    prompt_len: int
    teacher: _containers.RepeatedCompositeFieldContainer[TeacherRow]
    features: Features
    ready_only: bool
    unprepared: bool
    deliver: bool
    def __init__(self, seq_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., gamma: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., q_format: _Optional[_Union[QFormat, str]] = ..., traceparent: _Optional[str] = ..., prefill_only: _Optional[bool] = ..., prompt_len: _Optional[int] = ..., teacher: _Optional[_Iterable[_Union[TeacherRow, _Mapping]]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., ready_only: _Optional[bool] = ..., unprepared: _Optional[bool] = ..., deliver: _Optional[bool] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("data", "width", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    width: int
    dtype: FeatureDtype
    def __init__(self, data: _Optional[bytes] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[FeatureDtype, str]] = ...) -> None: ...

class TeacherRow(_message.Message):
    __slots__ = ("position", "token_ids", "logprobs")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequences", "dist_tag", "beside_target", "target_vocab")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DIST_TAG_FIELD_NUMBER: _ClassVar[int]
    BESIDE_TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ProposeSequence]
    dist_tag: int
    beside_target: bool
    target_vocab: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[ProposeSequence, _Mapping]]] = ..., dist_tag: _Optional[int] = ..., beside_target: _Optional[bool] = ..., target_vocab: _Optional[str] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "miss", "token_ids", "support_lens", "support_ids", "support_probs", "dense_q", "vocab_size", "cache_rank", "prepared")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MISS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_LENS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DENSE_Q_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_RANK_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    miss: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    support_lens: _containers.RepeatedScalarFieldContainer[int]
    support_ids: _containers.RepeatedScalarFieldContainer[int]
    support_probs: _containers.RepeatedScalarFieldContainer[float]
    dense_q: bytes
    vocab_size: int
    cache_rank: int
    prepared: _containers.RepeatedCompositeFieldContainer[PreparedOutcome]
    def __init__(self, seq_id: _Optional[str] = ..., miss: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., support_lens: _Optional[_Iterable[int]] = ..., support_ids: _Optional[_Iterable[int]] = ..., support_probs: _Optional[_Iterable[float]] = ..., dense_q: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., cache_rank: _Optional[int] = ..., prepared: _Optional[_Iterable[_Union[PreparedOutcome, _Mapping]]] = ...) -> None: ...

class PreparedOutcome(_message.Message):
    __slots__ = ("outcome", "token_ids", "rank")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    outcome: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    def __init__(self, outcome: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "draft_seconds", "draft_version", "target_topk")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOPK_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    draft_seconds: float
    draft_version: int
    target_topk: int
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., draft_version: _Optional[int] = ..., target_topk: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class DraftStatsRequest(_message.Message):
    __slots__ = ("target_vocab",)
    TARGET_VOCAB_FIELD_NUMBER: _ClassVar[int]
    target_vocab: str
    def __init__(self, target_vocab: _Optional[str] = ...) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("num_sequences", "num_used_blocks", "num_total_blocks", "num_evicted", "num_misses", "vocab_size", "max_model_len", "num_dense_sends", "model_name", "method", "feature_width", "speculation_cache")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DENSE_SENDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_CACHE_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    num_used_blocks: int
    num_total_blocks: int
    num_evicted: int
    num_misses: int
    vocab_size: int
    max_model_len: int
    num_dense_sends: int
    model_name: str
    method: str
    feature_width: int
    speculation_cache: bool
    def __init__(self, num_sequences: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_evicted: _Optional[int] = ..., num_misses: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_dense_sends: _Optional[int] = ..., model_name: _Optional[str] = ..., method: _Optional[str] = ..., feature_width: _Optional[int] = ..., speculation_cache: _Optional[bool] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "resume_output_ids", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "spec_mode", "gamma", "acceptance_prior", "traceparent", "logprobs", "proposer", "tree_topk", "tree_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPEC_MODE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PRIOR_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    TREE_TOPK_FIELD_NUMBER: _ClassVar[int]
    TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_output_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    spec_mode: SpecMode
    gamma: int
    acceptance_prior: _containers.RepeatedScalarFieldContainer[float]
    traceparent: str
    logprobs: int
    proposer: str
    tree_topk: int
    tree_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., resume_output_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., spec_mode: _Optional[_Union[SpecMode, str]] = ..., gamma: _Optional[int] = ..., acceptance_prior: _Optional[_Iterable[float]] = ..., traceparent: _Optional[str] = ..., logprobs: _Optional[int] = ..., proposer: _Optional[str] = ..., tree_topk: _Optional[int] = ..., tree_tokens: _Optional[int] = ...) -> None: ...

class RoundStats(_message.Message):
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

class TargetChunk(_message.Message):
    __slots__ = ("token_ids", "rounds", "finish_reason", "logprobs", "num_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundStats]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    num_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rounds: _Optional[_Iterable[_Union[RoundStats, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: TargetRequest
    cancel: CancelRequest
    def __init__(self, start: _Optional[_Union[TargetRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("request_id", "chunk", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TargetChunk
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TargetChunk, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class ServeStep(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[StepOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[StepOutput, _Mapping]]] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("verify_base_s", "verify_per_token_s", "knee_tokens", "draft_per_position_s", "draft_rtt_s", "draft_per_token_s", "plain_offset_s")
    VERIFY_BASE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    KNEE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PER_POSITION_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RTT_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PLAIN_OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    verify_base_s: float
    verify_per_token_s: float
    knee_tokens: int
    draft_per_position_s: float
    draft_rtt_s: float
    draft_per_token_s: float
    plain_offset_s: float
    def __init__(self, verify_base_s: _Optional[float] = ..., verify_per_token_s: _Optional[float] = ..., knee_tokens: _Optional[int] = ..., draft_per_position_s: _Optional[float] = ..., draft_rtt_s: _Optional[float] = ..., draft_per_token_s: _Optional[float] = ..., plain_offset_s: _Optional[float] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running", "num_waiting", "heat", "kv_used_blocks", "kv_total_blocks", "tokens_per_s", "model_pair", "cost", "max_batch_tokens", "gamma_max", "block_size", "prefix_caching", "queued_tokens", "metrics_port", "target_vocab")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_PAIR_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_MAX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    heat: float
    kv_used_blocks: int
    kv_total_blocks: int
    tokens_per_s: float
    model_pair: str
    cost: CostModel
    max_batch_tokens: int
    gamma_max: int
    block_size: int
    prefix_caching: bool
    queued_tokens: int
    metrics_port: int
    target_vocab: str
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., heat: _Optional[float] = ..., kv_used_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., model_pair: _Optional[str] = ..., cost: _Optional[_Union[CostModel, _Mapping]] = ..., max_batch_tokens: _Optional[int] = ..., gamma_max: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., queued_tokens: _Optional[int] = ..., metrics_port: _Optional[int] = ..., target_vocab: _Optional[str] = ...) -> None: ...

class DraftReplicas(_message.Message):
    __slots__ = ("addresses",)
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ...) -> None: ...
