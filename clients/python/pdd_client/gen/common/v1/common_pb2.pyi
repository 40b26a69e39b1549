from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pipeline(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIPELINE_UNSPECIFIED: _ClassVar[Pipeline]
    PIPELINE_P_MD: _ClassVar[Pipeline]
    PIPELINE_P_RLD_MD: _ClassVar[Pipeline]
    PIPELINE_MD: _ClassVar[Pipeline]

class HandoffMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_MODE_UNSPECIFIED: _ClassVar[HandoffMode]
    HANDOFF_MODE_ONE_SHOT: _ClassVar[HandoffMode]
    HANDOFF_MODE_CATCH_UP: _ClassVar[HandoffMode]

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_PREFILL: _ClassVar[Stage]
    STAGE_RELAY: _ClassVar[Stage]
    STAGE_MAIN_DECODE: _ClassVar[Stage]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_RELAY: _ClassVar[Role]
    ROLE_MAIN_DECODE: _ClassVar[Role]

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT8_E4M3: _ClassVar[KvDtype]

class KvCompression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_COMPRESSION_UNSPECIFIED: _ClassVar[KvCompression]
    KV_COMPRESSION_NONE: _ClassVar[KvCompression]
    KV_COMPRESSION_ZLIB: _ClassVar[KvCompression]
PIPELINE_UNSPECIFIED: Pipeline
PIPELINE_P_MD: Pipeline
PIPELINE_P_RLD_MD: Pipeline
PIPELINE_MD: Pipeline
HANDOFF_MODE_UNSPECIFIED: HandoffMode
HANDOFF_MODE_ONE_SHOT: HandoffMode
HANDOFF_MODE_CATCH_UP: HandoffMode
STAGE_UNSPECIFIED: Stage
STAGE_PREFILL: Stage
STAGE_RELAY: Stage
STAGE_MAIN_DECODE: Stage
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_RELAY: Role
ROLE_MAIN_DECODE: Role
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
KV_DTYPE_FLOAT8_E4M3: KvDtype
KV_COMPRESSION_UNSPECIFIED: KvCompression
KV_COMPRESSION_NONE: KvCompression
KV_COMPRESSION_ZLIB: KvCompression

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "grammar", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    grammar: str
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("dtype", "axes", "num_layers", "num_kv_heads", "head_dim", "block_size")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    AXES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    dtype: KvDtype
    axes: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    def __init__(self, dtype: _Optional[_Union[KvDtype, str]] = ..., axes: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class KvTransferHeader(_message.Message):
    __slots__ = ("request_id", "layout", "start_token", "num_tokens", "num_chunks", "total_bytes", "compression", "token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KvLayout
    start_token: int
    num_tokens: int
    num_chunks: int
    total_bytes: int
    compression: KvCompression
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., compression: _Optional[_Union[KvCompression, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "index", "offset", "data", "crc32")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    offset: int
    data: bytes
    crc32: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("start_position", "token_ids", "stage", "logprobs", "prompt_logprobs")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    stage: Stage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., stage: _Optional[_Union[Stage, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class InstanceRef(_message.Message):
    __slots__ = ("instance_id", "address", "role", "cluster")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    role: Role
    cluster: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., cluster: _Optional[str] = ...) -> None: ...

class FieldViolation(_message.Message):
    __slots__ = ("field", "description")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    field: str
    description: str
    def __init__(self, field: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...
