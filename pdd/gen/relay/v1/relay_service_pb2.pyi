from pdd.gen.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FastLinkTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAST_LINK_TRANSPORT_UNSPECIFIED: _ClassVar[FastLinkTransport]
    FAST_LINK_TRANSPORT_RDMA: _ClassVar[FastLinkTransport]
    FAST_LINK_TRANSPORT_SHM: _ClassVar[FastLinkTransport]
    FAST_LINK_TRANSPORT_TCP: _ClassVar[FastLinkTransport]
FAST_LINK_TRANSPORT_UNSPECIFIED: FastLinkTransport
FAST_LINK_TRANSPORT_RDMA: FastLinkTransport
FAST_LINK_TRANSPORT_SHM: FastLinkTransport
FAST_LINK_TRANSPORT_TCP: FastLinkTransport

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "main_decode", "handoff_mode", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAIN_DECODE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MODE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    main_decode: _common_pb2.InstanceRef
    handoff_mode: _common_pb2.HandoffMode
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., main_decode: _Optional[_Union[_common_pb2.InstanceRef, _Mapping]] = ..., handoff_mode: _Optional[_Union[_common_pb2.HandoffMode, str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("accepted", "tokens", "handed_off", "finished")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    tokens: _common_pb2.TokenDelta
    handed_off: HandedOff
    finished: Finished
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., handed_off: _Optional[_Union[HandedOff, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class HandedOff(_message.Message):
    __slots__ = ("at_position", "mode", "rounds", "handoff_ms")
    AT_POSITION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    at_position: int
    mode: _common_pb2.HandoffMode
    rounds: int
    handoff_ms: float
    def __init__(self, at_position: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.HandoffMode, str]] = ..., rounds: _Optional[int] = ..., handoff_ms: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "completion_tokens", "alone")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    completion_tokens: int
    alone: bool
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., completion_tokens: _Optional[int] = ..., alone: _Optional[bool] = ...) -> None: ...

class PrepareTransferRequest(_message.Message):
    __slots__ = ("request_id", "layout", "num_tokens", "total_bytes", "transports")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: _common_pb2.KvLayout
    num_tokens: int
    total_bytes: int
    transports: _containers.RepeatedScalarFieldContainer[FastLinkTransport]
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., total_bytes: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[FastLinkTransport, str]]] = ...) -> None: ...

class RdmaEndpoint(_message.Message):
    __slots__ = ("remote_addr", "rkey", "qp_num", "lid", "gid", "psn")
    REMOTE_ADDR_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    remote_addr: int
    rkey: int
    qp_num: int
    lid: int
    gid: bytes
    psn: int
    def __init__(self, remote_addr: _Optional[int] = ..., rkey: _Optional[int] = ..., qp_num: _Optional[int] = ..., lid: _Optional[int] = ..., gid: _Optional[bytes] = ..., psn: _Optional[int] = ...) -> None: ...

class PrepareTransferResponse(_message.Message):
    __slots__ = ("transport", "transfer_id", "rdma", "shm_name", "lease_ms")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    transport: FastLinkTransport
    transfer_id: str
    rdma: RdmaEndpoint
    shm_name: str
    lease_ms: int
    def __init__(self, transport: _Optional[_Union[FastLinkTransport, str]] = ..., transfer_id: _Optional[str] = ..., rdma: _Optional[_Union[RdmaEndpoint, _Mapping]] = ..., shm_name: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PushKvRequest(_message.Message):
    __slots__ = ("header", "chunk", "transfer_id")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.KvTransferHeader
    chunk: _common_pb2.KvChunk
    transfer_id: str
    def __init__(self, header: _Optional[_Union[_common_pb2.KvTransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.KvChunk, _Mapping]] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("bytes_received", "chunks_received")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    chunks_received: int
    def __init__(self, bytes_received: _Optional[int] = ..., chunks_received: _Optional[int] = ...) -> None: ...

class CompleteTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "header", "output_token_ids", "crc32")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    header: _common_pb2.KvTransferHeader
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    crc32: int
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., header: _Optional[_Union[_common_pb2.KvTransferHeader, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., crc32: _Optional[int] = ...) -> None: ...

class CompleteTransferResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

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
