from pdd.gen.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "pipeline", "relay", "main_decode", "main_decode_cached_tokens", "main_decode_cached_tokens_later", "burst_following")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    MAIN_DECODE_FIELD_NUMBER: _ClassVar[int]
    MAIN_DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAIN_DECODE_CACHED_TOKENS_LATER_FIELD_NUMBER: _ClassVar[int]
    BURST_FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    pipeline: _common_pb2.Pipeline
    relay: _common_pb2.InstanceRef
    main_decode: _common_pb2.InstanceRef
    main_decode_cached_tokens: int
    main_decode_cached_tokens_later: bool
    burst_following: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., pipeline: _Optional[_Union[_common_pb2.Pipeline, str]] = ..., relay: _Optional[_Union[_common_pb2.InstanceRef, _Mapping]] = ..., main_decode: _Optional[_Union[_common_pb2.InstanceRef, _Mapping]] = ..., main_decode_cached_tokens: _Optional[int] = ..., main_decode_cached_tokens_later: _Optional[bool] = ..., burst_following: _Optional[int] = ...) -> None: ...

class BindMainDecodeRequest(_message.Message):
    __slots__ = ("request_id", "main_decode_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAIN_DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    main_decode_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., main_decode_cached_tokens: _Optional[int] = ...) -> None: ...

class BindMainDecodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "prompt_tokens", "cached_tokens", "prefill_ms", "logprob", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    prompt_tokens: int
    cached_tokens: int
    prefill_ms: float
    logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("relay_kv_bytes", "wan_kv_bytes", "relay_transfer_ms", "wan_transfer_ms", "wan_queue_ms", "fast_link")
    RELAY_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAN_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    WAN_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    WAN_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FAST_LINK_FIELD_NUMBER: _ClassVar[int]
    relay_kv_bytes: int
    wan_kv_bytes: int
    relay_transfer_ms: float
    wan_transfer_ms: float
    wan_queue_ms: float
    fast_link: str
    def __init__(self, relay_kv_bytes: _Optional[int] = ..., wan_kv_bytes: _Optional[int] = ..., relay_transfer_ms: _Optional[float] = ..., wan_transfer_ms: _Optional[float] = ..., wan_queue_ms: _Optional[float] = ..., fast_link: _Optional[str] = ...) -> None: ...

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
