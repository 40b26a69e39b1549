from pdd.gen.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "session_id", "cache_salt", "force_pipeline", "handoff_mode", "top_k", "ignore_eos", "request_id", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "grammar", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FORCE_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MODE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: PromptTokenIds
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: str
    cache_salt: str
    force_pipeline: _common_pb2.Pipeline
    handoff_mode: _common_pb2.HandoffMode
    top_k: int
    ignore_eos: bool
    request_id: str
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    grammar: str
    prompt_logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[PromptTokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., force_pipeline: _Optional[_Union[_common_pb2.Pipeline, str]] = ..., handoff_mode: _Optional[_Union[_common_pb2.HandoffMode, str]] = ..., top_k: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PromptTokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "stage", "start_position", "finish_reason", "stats", "request_id", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    stage: _common_pb2.Stage
    start_position: int
    finish_reason: _common_pb2.FinishReason
    stats: GenerateStats
    request_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., stage: _Optional[_Union[_common_pb2.Stage, str]] = ..., start_position: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("pipeline", "handoff_mode", "prompt_tokens", "completion_tokens", "rld_tokens", "md_tokens", "predicted_hit_rate", "md_cached_tokens", "wan_kv_bytes", "ttft_ms", "handoff_at_token", "prefill_instance", "relay_instance", "main_decode_instance", "prefill_cached_tokens", "e2e_ms", "wan_transfer_ms", "migrations")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MD_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAN_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RELAY_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MAIN_DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    WAN_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    pipeline: _common_pb2.Pipeline
    handoff_mode: _common_pb2.HandoffMode
    prompt_tokens: int
    completion_tokens: int
    rld_tokens: int
    md_tokens: int
    predicted_hit_rate: float
    md_cached_tokens: int
    wan_kv_bytes: int
    ttft_ms: float
    handoff_at_token: int
    prefill_instance: str
    relay_instance: str
    main_decode_instance: str
    prefill_cached_tokens: int
    e2e_ms: float
    wan_transfer_ms: float
    migrations: int
    def __init__(self, pipeline: _Optional[_Union[_common_pb2.Pipeline, str]] = ..., handoff_mode: _Optional[_Union[_common_pb2.HandoffMode, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., rld_tokens: _Optional[int] = ..., md_tokens: _Optional[int] = ..., predicted_hit_rate: _Optional[float] = ..., md_cached_tokens: _Optional[int] = ..., wan_kv_bytes: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., handoff_at_token: _Optional[int] = ..., prefill_instance: _Optional[str] = ..., relay_instance: _Optional[str] = ..., main_decode_instance: _Optional[str] = ..., prefill_cached_tokens: _Optional[int] = ..., e2e_ms: _Optional[float] = ..., wan_transfer_ms: _Optional[float] = ..., migrations: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_context_tokens", "vocab_size", "eos_token_ids", "has_tokenizer", "chat_template")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_context_tokens: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_tokenizer: bool
    chat_template: str
    def __init__(self, model: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_tokenizer: _Optional[bool] = ..., chat_template: _Optional[str] = ...) -> None: ...
