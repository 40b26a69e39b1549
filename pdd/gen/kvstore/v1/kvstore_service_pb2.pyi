from pdd.gen.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_EVENT_KIND_UNSPECIFIED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_STORED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_EVICTED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_CLEARED: _ClassVar[CacheEventKind]
CACHE_EVENT_KIND_UNSPECIFIED: CacheEventKind
CACHE_EVENT_KIND_STORED: CacheEventKind
CACHE_EVENT_KIND_EVICTED: CacheEventKind
CACHE_EVENT_KIND_CLEARED: CacheEventKind

class InstanceLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_blocks_used", "kv_blocks_total", "links")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    links: _containers.RepeatedCompositeFieldContainer[LinkState]
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkState, _Mapping]]] = ...) -> None: ...

class LinkState(_message.Message):
    __slots__ = ("cluster", "throughput_bps", "queued_bytes", "in_flight_bytes", "rtt_s", "measured_at_ms", "healthy")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_BPS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    throughput_bps: float
    queued_bytes: int
    in_flight_bytes: int
    rtt_s: float
    measured_at_ms: int
    healthy: bool
    def __init__(self, cluster: _Optional[str] = ..., throughput_bps: _Optional[float] = ..., queued_bytes: _Optional[int] = ..., in_flight_bytes: _Optional[int] = ..., rtt_s: _Optional[float] = ..., measured_at_ms: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("ref", "block_size", "model", "load", "last_heartbeat_ms")
    REF_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.InstanceRef
    block_size: int
    model: str
    load: InstanceLoad
    last_heartbeat_ms: int
    def __init__(self, ref: _Optional[_Union[_common_pb2.InstanceRef, _Mapping]] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., last_heartbeat_ms: _Optional[int] = ...) -> None: ...

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("ref", "block_size", "model", "ttl_ms", "reset_index")
    REF_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RESET_INDEX_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.InstanceRef
    block_size: int
    model: str
    ttl_ms: int
    reset_index: bool
    def __init__(self, ref: _Optional[_Union[_common_pb2.InstanceRef, _Mapping]] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., reset_index: _Optional[bool] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id", "load")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    load: InstanceLoad
    def __init__(self, instance_id: _Optional[str] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterInstanceRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "parent_hash", "cache_salt")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    kind: CacheEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    cache_salt: str
    def __init__(self, kind: _Optional[_Union[CacheEventKind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PublishCacheEventsRequest(_message.Message):
    __slots__ = ("instance_id", "events", "first_seq")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    first_seq: int
    def __init__(self, instance_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., first_seq: _Optional[int] = ...) -> None: ...

class PublishCacheEventsResponse(_message.Message):
    __slots__ = ("applied", "resync")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    applied: int
    resync: bool
    def __init__(self, applied: _Optional[int] = ..., resync: _Optional[bool] = ...) -> None: ...

class PromptChain(_message.Message):
    __slots__ = ("block_size", "block_hashes_packed")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_PACKED_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    block_hashes_packed: bytes
    def __init__(self, block_size: _Optional[int] = ..., block_hashes_packed: _Optional[bytes] = ...) -> None: ...

class PredictHitsRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_token_ids_packed", "prompt_chains", "prompt_tokens", "cache_salt", "instance_ids", "role")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CHAINS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids_packed: bytes
    prompt_chains: _containers.RepeatedCompositeFieldContainer[PromptChain]
    prompt_tokens: int
    cache_salt: str
    instance_ids: _containers.RepeatedScalarFieldContainer[str]
    role: _common_pb2.Role
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids_packed: _Optional[bytes] = ..., prompt_chains: _Optional[_Iterable[_Union[PromptChain, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., instance_ids: _Optional[_Iterable[str]] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class InstanceHit(_message.Message):
    __slots__ = ("instance", "cached_tokens", "hit_rate")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceInfo
    cached_tokens: int
    hit_rate: float
    def __init__(self, instance: _Optional[_Union[InstanceInfo, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ...) -> None: ...

class PredictHitsResponse(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[InstanceHit]
    def __init__(self, hits: _Optional[_Iterable[_Union[InstanceHit, _Mapping]]] = ...) -> None: ...
