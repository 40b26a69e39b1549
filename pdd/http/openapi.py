"""The OpenAPI 3.1 document of the OpenAI-compatible API, served at ``GET /openapi.json``.

It states what ``openai_convert`` accepts — each body field with the converter's own limits
(``MAX_N``, ``MAX_STOP_STRINGS``, ``MAX_LOGPROBS``, ...) — so that standard API fuzzers and
client generators can drive the gateway. ``tests/unit/test_http_openapi.py`` reads the
converter's source and fails when a field it reads is missing here, or one listed here is
not read there. Fields the converter refuses (``suffix``, ``tools``, chat's ``echo``, ...) are
not listed; unknown fields are ignored, as OpenAI's own API does.
"""

from __future__ import annotations

from typing import Any

from pdd.core.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, PENALTY_LIMIT
from pdd.http import openai_convert as conv
from pdd.http.chat_template import ROLES

OPENAPI_VERSION = "3.1.0"
_U32_MAX, _U64_MAX = 2**32 - 1, 2**64 - 1
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": _U32_MAX}}


def _num(description: str, **limits: Any) -> dict[str, Any]:
    return {"type": "number", "description": description, **limits}


def _int(description: str, lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi, "description": description}


# Fields both routes read (``_common``, ``_generate_request``, ``request_timeout``, the model).
COMMON_FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string", "description": "the id GET /v1/models lists"},
    "stream": {"type": "boolean", "description": "server-sent events ending in data: [DONE]"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
        "description": "only with stream: true",
    },
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "maxItems": conv.MAX_STOP_STRINGS,
            },
        ],
        "description": "stop strings (cut from the text)",
    },
    "n": _int("choices, each a whole generation", 1, conv.MAX_N),
    "temperature": _num("0 = greedy", minimum=0),
    "top_p": _num("nucleus sampling", exclusiveMinimum=0, maximum=1),
    "top_k": _int("-1 or 0 = off (at most the vocabulary size)", -1, _U32_MAX),
    "seed": _int("seeded sampling (choice j draws with seed + j)", 0, _U64_MAX),
    "presence_penalty": _num("OpenAI's", minimum=-PENALTY_LIMIT, maximum=PENALTY_LIMIT),
    "frequency_penalty": _num("OpenAI's", minimum=-PENALTY_LIMIT, maximum=PENALTY_LIMIT),
    "repetition_penalty": _num("vLLM's; 1 = off", exclusiveMinimum=0),
    "logit_bias": {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": _num(
            "the bias", minimum=-LOGIT_BIAS_LIMIT, maximum=LOGIT_BIAS_LIMIT
        ),
        "description": "token id → bias added to its logit",
    },
    "response_format": {
        "type": "object",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}},
            },
        },
        "required": ["type"],
        "description": "structured output",
    },
    "stop_token_ids": {**_TOKEN_IDS, "description": "token ids that end the output"},
    "ignore_eos": {"type": "boolean", "description": "generate past the end-of-sequence token"},
    "session_id": {"type": "string", "maxLength": 128, "pattern": "^[\\x21-\\x7e]*$"},
    "cache_salt": {
        "type": "string",
        "maxLength": 128,
        "pattern": "^[\\x21-\\x7e]*$",
        "description": "partitions the prefix caches; with tenant keys, within the key's tenant",
    },
    "return_token_ids": {"type": "boolean", "description": "token ids beside the text"},
    "prompt_logprobs": _int("top k logprobs per prompt token (not streamed)", 0, MAX_LOGPROBS),
    "timeout": _num(
        "seconds until the request's deadline at every stage; past it 504 "
        f"(or the {conv.TIMEOUT_HEADER} header)",
        exclusiveMinimum=0,
        maximum=conv.MAX_TIMEOUT_S,
    ),
}

_PROMPT = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {**_TOKEN_IDS, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": conv.MAX_PROMPTS,
        },
        {
            "type": "array",
            "items": {**_TOKEN_IDS, "minItems": 1},
            "minItems": 1,
            "maxItems": conv.MAX_PROMPTS,
        },
    ],
    "description": "text, token ids, or a batch of either",
}

COMPLETION_FIELDS: dict[str, dict[str, Any]] = {
    **COMMON_FIELDS,
    "prompt": _PROMPT,
    "max_tokens": _int("output tokens (0 with echo: the prompt alone)", 0, _U32_MAX),
    "echo": {"type": "boolean", "description": "the prompt before the text"},
    "logprobs": _int("top k logprobs per output token", 0, MAX_LOGPROBS),
}

_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {
            "oneOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"],
                    },
                },
            ]
        },
    },
    "required": ["role"],
}

CHAT_FIELDS: dict[str, dict[str, Any]] = {
    **COMMON_FIELDS,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_tokens": _int("output tokens (default: up to the end of the context)", 0, _U32_MAX),
    "max_completion_tokens": _int("output tokens, as max_tokens", 0, _U32_MAX),
    "logprobs": {"type": "boolean", "description": "logprobs of the output tokens"},
    "top_logprobs": _int("top k logprobs per output token (with logprobs)", 0, MAX_LOGPROBS),
}

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}

_RESPONSE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": _USAGE,
    },
    "required": ["id", "object", "created", "model", "choices"],
}

# HTTP status → when the API answers it (every error body is an Error)
_ERRORS = {
    "400": "a field is invalid (error.param names it)",
    "401": "no or a wrong API key",
    "404": "an unknown model or route",
    "413": "the body is larger than the limit",
    "429": "the gateway or a stage is full (Retry-After)",
    "500": "the pipeline broke mid-request",
    "503": "no instance of a role is available",
    "504": "the request's timeout passed",
}


def _errors(*codes: str) -> dict[str, Any]:
    return {
        c: {
            "description": _ERRORS[c],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for c in codes
    }


def _generate_op(summary: str, schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {}],
            "parameters": [
                {
                    "name": conv.TIMEOUT_HEADER,
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "seconds until the deadline when the body has no timeout",
                },
                {"name": "X-Request-Id", "in": "header", "schema": {"type": "string"}},
                {"name": conv.PIPELINE_HEADER, "in": "header", "schema": {"type": "string"}},
                {"name": conv.HANDOFF_HEADER, "in": "header", "schema": {"type": "string"}},
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "the response, or with stream: true server-sent chunks",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Response"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors("400", "401", "404", "413", "429", "500", "503", "504"),
            },
        }
    }


def _get(summary: str, *errors: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": {}}}},
                **_errors(*errors),
            },
        }
    }


def document(model: str) -> dict[str, Any]:
    """The API's OpenAPI document; ``model``: the id the gateway serves."""
    model_get = _get("one model", "401", "404")
    model_get["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    metrics = _get("Prometheus metrics")
    metrics["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "PDD OpenAI-compatible API",
            "version": "1",
            "description": f"The gateway's OpenAI-compatible API, serving {model!r}.",
        },
        "paths": {
            "/v1/completions": _generate_op("text completions", "CompletionRequest"),
            "/v1/chat/completions": _generate_op("chat completions", "ChatCompletionRequest"),
            "/v1/models": _get("the served model", "401"),
            "/v1/models/{model}": model_get,
            "/health": _get("liveness"),
            "/ready": _get("every role has an instance", "503"),
            "/metrics": metrics,
            "/openapi.json": _get("this document"),
        },
        "components": {
            "schemas": {
                "CompletionRequest": {
                    "type": "object",
                    "properties": COMPLETION_FIELDS,
                    "required": ["model", "prompt"],
                },
                "ChatCompletionRequest": {
                    "type": "object",
                    "properties": CHAT_FIELDS,
                    "required": ["model", "messages"],
                },
                "Response": _RESPONSE,
                "Error": _ERROR,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
