from outrider.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRecord(_message.Message):
    __slots__ = ("address", "load", "heartbeat_unix_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    load: _worker_pb2.Load
    heartbeat_unix_s: float
    def __init__(self, address: _Optional[str] = ..., load: _Optional[_Union[_worker_pb2.Load, _Mapping]] = ..., heartbeat_unix_s: _Optional[float] = ...) -> None: ...

class ApiKeyRecord(_message.Message):
    __slots__ = ("name", "requests_per_minute", "burst", "tags", "disabled")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests_per_minute: int
    burst: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    disabled: bool
    def __init__(self, name: _Optional[str] = ..., requests_per_minute: _Optional[int] = ..., burst: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ..., disabled: _Optional[bool] = ...) -> None: ...

class JournalRecord(_message.Message):
    __slots__ = ("fingerprint", "prompt_ids", "is_finished", "response", "seed")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    is_finished: bool
    response: bytes
    seed: int
    def __init__(self, fingerprint: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., is_finished: _Optional[bool] = ..., response: _Optional[bytes] = ..., seed: _Optional[int] = ...) -> None: ...
