from pdd.gen.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "pipeline", "resume_token_ids", "burst_following")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BURST_FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    pipeline: _common_pb2.Pipeline
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    burst_following: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., pipeline: _Optional[_Union[_common_pb2.Pipeline, str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., burst_following: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("accepted", "tokens", "finished")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    tokens: _common_pb2.TokenDelta
    finished: Finished
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class DecodeManyRequest(_message.Message):
    __slots__ = ("call_id", "decode", "cancel", "timeout_ms")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    decode: DecodeRequest
    cancel: DecodeCancel
    timeout_ms: int
    def __init__(self, call_id: _Optional[int] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[_Union[DecodeCancel, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class DecodeCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeManyResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeManyEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeManyEvent, _Mapping]]] = ...) -> None: ...

class DecodeManyEvent(_message.Message):
    __slots__ = ("call_id", "accepted", "tokens", "finished", "end")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    accepted: Accepted
    tokens: _common_pb2.TokenDelta
    finished: Finished
    end: DecodeEnd
    def __init__(self, call_id: _Optional[int] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., end: _Optional[_Union[DecodeEnd, _Mapping]] = ...) -> None: ...

class DecodeEnd(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("instance_id", "cached_tokens")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    cached_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "completion_tokens", "md_tokens", "wan_kv_bytes_received", "extend_ms")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAN_KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EXTEND_MS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    completion_tokens: int
    md_tokens: int
    wan_kv_bytes_received: int
    extend_ms: float
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., completion_tokens: _Optional[int] = ..., md_tokens: _Optional[int] = ..., wan_kv_bytes_received: _Optional[int] = ..., extend_ms: _Optional[float] = ...) -> None: ...

class KvTransferCommit(_message.Message):
    __slots__ = ("request_id", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PushKvRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.KvTransferHeader
    chunk: _common_pb2.KvChunk
    commit: KvTransferCommit
    def __init__(self, header: _Optional[_Union[_common_pb2.KvTransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.KvChunk, _Mapping]] = ..., commit: _Optional[_Union[KvTransferCommit, _Mapping]] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("request_id", "bytes_received", "chunks_received", "missing_chunk_indices", "complete")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MISSING_CHUNK_INDICES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bytes_received: int
    chunks_received: int
    missing_chunk_indices: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    def __init__(self, request_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., chunks_received: _Optional[int] = ..., missing_chunk_indices: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ...) -> None: ...

class GetKvTransferRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetKvTransferResponse(_message.Message):
    __slots__ = ("known", "num_chunks", "missing_chunk_indices", "complete")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_CHUNK_INDICES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    num_chunks: int
    missing_chunk_indices: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    def __init__(self, known: _Optional[bool] = ..., num_chunks: _Optional[int] = ..., missing_chunk_indices: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ...) -> None: ...

class WaitKvReadyRequest(_message.Message):
    __slots__ = ("request_id", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WaitKvReadyResponse(_message.Message):
    __slots__ = ("ready", "decode_interval_ms")
    READY_FIELD_NUMBER: _ClassVar[int]
    DECODE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    decode_interval_ms: float
    def __init__(self, ready: _Optional[bool] = ..., decode_interval_ms: _Optional[float] = ...) -> None: ...

class TokenHandoffRequest(_message.Message):
    __slots__ = ("request_id", "start_position", "token_ids", "final", "request_finished", "mode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    request_finished: bool
    mode: _common_pb2.HandoffMode
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ..., request_finished: _Optional[bool] = ..., mode: _Optional[_Union[_common_pb2.HandoffMode, str]] = ...) -> None: ...

class TokenHandoffResponse(_message.Message):
    __slots__ = ("extended_through", "extend_ms", "computed_through", "decode_interval_ms")
    EXTENDED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    EXTEND_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    DECODE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    extended_through: int
    extend_ms: float
    computed_through: int
    decode_interval_ms: float
    def __init__(self, extended_through: _Optional[int] = ..., extend_ms: _Optional[float] = ..., computed_through: _Optional[int] = ..., decode_interval_ms: _Optional[float] = ...) -> None: ...

class DescribeCacheRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class DescribeCacheResponse(_message.Message):
    __slots__ = ("cached_prefix_tokens", "kv_blocks_used", "kv_blocks_total", "request_holds_kv", "block_size")
    CACHED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HOLDS_KV_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    cached_prefix_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    request_holds_kv: bool
    block_size: int
    def __init__(self, cached_prefix_tokens: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., request_holds_kv: _Optional[bool] = ..., block_size: _Optional[int] = ...) -> None: ...
