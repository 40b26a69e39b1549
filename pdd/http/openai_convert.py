"""OpenAI JSON → PDD: request bodies → ``GenerateJob`` (the responses: ``openai_responses``).

A body is type-checked here, turned into the same ``GenerateRequest`` the
gRPC face receives, and validated by ``pdd.wire.gateway.generate_from_pb``
— one set of rules for both faces; an ``InvalidArgumentError`` names the
field (HTTP 400). Supported: ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``
(strings), ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``n``
(up to ``MAX_N``), ``logprobs`` (chat: ``logprobs`` + ``top_logprobs``),
``response_format`` (text, json_object, json_schema: structured output),
``stream`` + ``stream_options.include_usage``; vLLM-style extras ``top_k``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``cache_salt``,
``session_id``, ``return_token_ids``, ``prompt_logprobs`` (not streamed). Completions
also take a batch — ``prompt`` as a list of strings or of token-id lists, choice
``prompt_index * n + j`` — and ``echo`` (the prompt before the text; with ``logprobs``,
the prompt tokens' logprobs first, the first one null; ``max_tokens: 0`` then returns
the prompt alone, as vLLM does). Features PDD does not have (suffix, tools, chat's
echo, ...) are refused rather than silently ignored.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdd.core.errors import InvalidArgumentError
from pdd.core.model_info import ModelInfo
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.request import GenerateJob
from pdd.core.sampling_params import MAX_LOGPROBS
from pdd.engine import grammar
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.http.chat_template import render_chat
from pdd.wire.gateway import generate_from_pb

COMPLETION, CHAT = "text_completion", "chat.completion"
_U32, _U64 = 2**32, 2**64
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request: each is a whole generation
MAX_PROMPTS = 256  # prompts in one completions batch: each runs as requests of its own
# Operators' and tests' overrides of the router, as gRPC's force_pipeline / handoff_mode
PIPELINE_HEADER, HANDOFF_HEADER = "X-PDD-Pipeline", "X-PDD-Handoff-Mode"
# The request's deadline in seconds when the body has no ``timeout`` (a proxy's or a client's
# that cannot add body fields). NOTE: openai-python's own ``timeout=`` stays in the client; the
# ``x-stainless-read-timeout`` header it sends is a read (between-bytes) timeout, not a deadline.
TIMEOUT_HEADER = "X-Request-Timeout"
MAX_TIMEOUT_S = 24 * 3600.0


@dataclass(frozen=True)
class ApiRequest:
    kind: str  # COMPLETION | CHAT
    model: str
    jobs: tuple[GenerateJob, ...]  # one per prompt (a completions batch has several)
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    return_token_ids: bool = False
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    echo: bool = False
    # The prompts as given, for echo (None: given as token ids, so detokenized)
    prompt_texts: tuple[str | None, ...] = ()
    # False: echo with max_tokens 0 — the prompt alone (the one token generated is dropped)
    generate: bool = True
    # vLLM's prompt_logprobs extra: the top k per prompt token in the choice's prompt_logprobs
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.jobs:
            raise ValueError("jobs: at least one prompt")
        if not self.generate and not self.echo:
            raise ValueError("generate: False only with echo")

    @property
    def job(self) -> GenerateJob:
        """The first prompt's job (its id names the response)."""
        return self.jobs[0]

    @property
    def logprobs(self) -> bool:
        """Whether the request asked for logprobs."""
        return self.job.sampling.logprobs is not None

    @property
    def num_choices(self) -> int:
        return len(self.jobs) * self.n

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == CHAT else "cmpl-") + self.job.request_id

    def prompt_of(self, choice: int) -> GenerateJob:
        return self.jobs[choice // self.n]

    def routed(self, pipeline: Pipeline | None, mode: HandoffMode | None) -> ApiRequest:
        """Every job forced onto ``pipeline`` / ``mode`` (the router's overrides; None: keep)."""
        if pipeline is None and mode is None:
            return self
        jobs = tuple(
            replace(
                j,
                force_pipeline=pipeline or j.force_pipeline,
                handoff_mode=mode or j.handoff_mode,
            )
            for j in self.jobs
        )
        return replace(self, jobs=jobs)

    def for_tenant(self, tenant: str) -> ApiRequest:
        """Every job's cache salt made its tenant's (``tenant_salt``)."""
        jobs = tuple(replace(j, cache_salt=tenant_salt(tenant, j.cache_salt)) for j in self.jobs)
        return replace(self, jobs=jobs)

    def choice_jobs(self) -> list[GenerateJob]:
        """One request life per choice, choice ``p * n + j`` for prompt ``p``: ``n`` requests with
        the same prompt (so the later ones find it in the prefix caches), ids
        ``<request_id>-<choice>``; with a seed, choice ``j`` of a prompt draws with ``seed + j``
        (vLLM's rule), so choice 0 is what ``n = 1`` would give."""
        if self.num_choices == 1:
            return [self.job]
        jobs = []
        for index in range(self.num_choices):
            job, j = self.prompt_of(index), index % self.n
            suffix = f"-{index}"
            sampling = job.sampling
            if sampling.seed is not None:
                sampling = replace(sampling, seed=(sampling.seed + j) % _U64)
            jobs.append(
                replace(
                    job,
                    request_id=self.job.request_id[: 128 - len(suffix)] + suffix,
                    sampling=sampling,
                )
            )
        return jobs


def tenant_salt(tenant: str, salt: str) -> str:
    """The cache salt of a request of ``tenant`` that sent ``salt``: a digest of both, so a
    client's salt partitions its own tenant's cache but can never name another tenant's (no
    salt a client may send is another tenant's digest: every salt over HTTP is one)."""
    # NOTE: length-prefixed, so ("a", "bc") and ("ab", "c") differ
    digest = hashlib.sha256(f"{len(tenant)}:{tenant}:{salt}".encode()).hexdigest()
    return f"tenant-{digest[:48]}"


def route_overrides(pipeline: str, mode: str) -> tuple[Pipeline | None, HandoffMode | None]:
    """The router overrides named by the ``X-PDD-Pipeline`` / ``X-PDD-Handoff-Mode`` headers
    ("" = none), e.g. ``p-rld-md`` and ``catch-up``."""
    out = []
    for header, value, kind in (
        (PIPELINE_HEADER, pipeline, Pipeline),
        (HANDOFF_HEADER, mode, HandoffMode),
    ):
        try:
            out.append(kind(value.strip().lower()) if value else None)
        except ValueError:
            names = ", ".join(v.value for v in kind)
            raise InvalidArgumentError(header, f"must be one of {names}, got {value!r}") from None
    return out[0], out[1]


def request_timeout(body: dict, header: str) -> float | None:
    """The request's deadline in seconds from now (None: none): the body's ``timeout`` (as
    vLLM-style clients send it, e.g. openai-python's ``extra_body={"timeout": 30}``), else the
    ``X-Request-Timeout`` header. Past it the request is cancelled at every stage (HTTP 504)."""
    name, value = "timeout", body.get("timeout")
    if value is None and header.strip():
        name = TIMEOUT_HEADER
        try:
            value = float(header)
        except ValueError:
            raise InvalidArgumentError(
                name, f"must be a number of seconds, got {header!r}"
            ) from None
    if value is None:
        return None
    # NOTE: written so that NaN fails too
    if not (_is_number(value) and 0 < value <= MAX_TIMEOUT_S):
        raise InvalidArgumentError(
            name, f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}"
        )
    return float(value)


# ---- type checks ------------------------------------------------------------------
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v < hi:
        raise InvalidArgumentError(name, f"must be an integer in [{lo}, {hi - 1}], got {v!r}")
    return v


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise InvalidArgumentError(name, f"must be a number, got {v!r}")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidArgumentError(name, f"must be true or false, got {v!r}")
    return v


def _str(body: dict, name: str) -> str:
    v = body.get(name, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise InvalidArgumentError(name, f"must be a string, got {v!r}")
    return v


def _token_ids(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < _U32 for t in v):
        raise InvalidArgumentError(name, "must be a list of token ids (integers >= 0)")
    return v


def _stop_strings(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgumentError("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    return tuple(stops)


def _refuse_unsupported(body: dict, kind: str) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise InvalidArgumentError("best_of", "only best_of=1 is supported")
    if kind == CHAT and body.get("echo") not in (None, False):
        raise InvalidArgumentError("echo", "is not supported for chat completions")
    for name in ("suffix", "tools", "functions"):
        if body.get(name):
            raise InvalidArgumentError(name, "is not supported")


def _response_format(fmt: Any) -> str:
    """OpenAI's ``response_format`` as a grammar ('' for plain text): ``json_object`` is any JSON
    object, ``json_schema`` JSON that follows ``json_schema.schema``."""
    if fmt is None:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return grammar.from_json_schema({"type": "object"})
    if kind != "json_schema":
        raise InvalidArgumentError(
            "response_format", 'must be {"type": "text" | "json_object" | "json_schema"}'
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidArgumentError(
            "response_format.json_schema", 'must be an object with a "schema" object'
        )
    try:
        return grammar.from_json_schema(spec.get("schema", {}))
    except ValueError as exc:
        raise InvalidArgumentError(
            "response_format.json_schema.schema", f"is not a usable JSON schema: {exc}"
        ) from None


# ---- requests ---------------------------------------------------------------------
def _generate_request(body: dict, request_id: str, max_tokens: int) -> pb.GenerateRequest:
    top_k = _int(body, "top_k", -1, _U32, 0)
    req = pb.GenerateRequest(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=max(top_k, 0),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        session_id=_str(body, "session_id"),
        cache_salt=_str(body, "cache_salt"),
        request_id=request_id,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
    )
    # NOTE: on the wire 0 means "off" (1.0); a body that says 0 asks for something invalid.
    repetition = _number(body, "repetition_penalty", 1.0)
    if not repetition > 0:
        raise InvalidArgumentError(
            "repetition_penalty", f"must be a finite number > 0, got {repetition}"
        )
    req.repetition_penalty = repetition
    if fmt := _response_format(body.get("response_format")):
        req.grammar = fmt
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InvalidArgumentError("logit_bias", "must be an object of token id → bias")
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()) or int(key) >= _U32:
                raise InvalidArgumentError("logit_bias", f"keys must be token ids, got {key!r}")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InvalidArgumentError(f"logit_bias[{key}]", f"must be a number, got {value!r}")
            req.logit_bias[int(key)] = float(value)
    seed = _int(body, "seed", 0, _U64)
    if seed is not None:
        req.seed = seed
    return req


def _common(body: Any, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    _refuse_unsupported(body, kind)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise InvalidArgumentError(
            "stream_options", "is only allowed as an object with stream: true"
        )
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_LOGPROBS + 1)
    if prompt_logprobs is not None and stream:
        raise InvalidArgumentError("prompt_logprobs", "is not supported with stream: true")
    return dict(
        prompt_logprobs=prompt_logprobs,
        kind=kind,
        model=body.get("model"),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        stop=_stop_strings(body),
        return_token_ids=_bool(body, "return_token_ids"),
        n=_int(body, "n", 1, MAX_N + 1, 1),
    )


_PROMPT_SHAPES = "a string, a list of token ids, or a batch: a list of strings or of token-id lists"


def _prompts(body: dict) -> list[str | list[int] | None]:
    """``prompt`` as a list of prompts (one unless a batch); None: absent (the converter says so)."""
    prompt = body.get("prompt")
    if prompt is None or isinstance(prompt, str):
        if prompt == "":
            raise InvalidArgumentError("prompt", "must not be empty")
        return [prompt]
    if not isinstance(prompt, list):
        raise InvalidArgumentError("prompt", f"must be {_PROMPT_SHAPES}")
    if not prompt:
        raise InvalidArgumentError("prompt", "must not be empty")
    if not all(isinstance(p, (str, list)) for p in prompt):
        return [_token_ids(prompt, "prompt")]
    if len({type(p) for p in prompt}) != 1:
        raise InvalidArgumentError("prompt", f"must be {_PROMPT_SHAPES}, not a mix")
    if len(prompt) > MAX_PROMPTS:
        raise InvalidArgumentError("prompt", f"at most {MAX_PROMPTS} prompts in one batch")
    for i, p in enumerate(prompt):
        if not p:
            raise InvalidArgumentError(f"prompt[{i}]", "must not be empty")
        if isinstance(p, list):
            _token_ids(p, f"prompt[{i}]")
    return prompt


def completion_request(body: Any, info: ModelInfo, request_id: str) -> ApiRequest:
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a batch of either."""
    common = _common(body, COMPLETION)
    prompts = _prompts(body)
    echo = _bool(body, "echo")
    max_tokens = _int(body, "max_tokens", 0, _U32, DEFAULT_COMPLETION_MAX_TOKENS)
    # NOTE: echo with max_tokens 0 (vLLM's echo without generation): one token is generated and
    # dropped, so every request life still has an output position 0 carrying the prompt's scores.
    generate = not (echo and max_tokens == 0)
    template = _generate_request(body, request_id, max_tokens if generate else 1)
    # NOTE: OpenAI's completions logprobs: the top k, and always the sampled token's
    k = _int(body, "logprobs", 0, MAX_LOGPROBS + 1)
    if k is not None:
        template.logprobs = k
    scored = [v for v in (k if echo else None, common["prompt_logprobs"]) if v is not None]
    if scored:
        template.prompt_logprobs = max(scored)
    jobs = []
    for i, prompt in enumerate(prompts):
        req = pb.GenerateRequest()
        req.CopyFrom(template)
        if isinstance(prompt, str):
            req.prompt = prompt
        elif prompt is not None:
            req.prompt_token_ids.token_ids.extend(prompt)
        if len(prompts) == 1:
            jobs.append(generate_from_pb(req, info))
            continue
        try:
            jobs.append(generate_from_pb(req, info))
        except InvalidArgumentError as exc:
            if not exc.field.startswith("prompt"):
                raise
            raise InvalidArgumentError(f"prompt[{i}]", f"{exc.field}: {exc.description}") from None
    texts = tuple(p if isinstance(p, str) else None for p in prompts)
    return ApiRequest(jobs=tuple(jobs), echo=echo, prompt_texts=texts, generate=generate, **common)


def chat_request(body: Any, info: ModelInfo, request_id: str) -> ApiRequest:
    """``POST /v1/chat/completions``: ``messages`` through the model's chat template."""
    common = _common(body, CHAT)
    text = render_chat(info.chat_template, body.get("messages"))
    if info.encode is None:
        raise InvalidArgumentError("messages", f"model {info.name} has no tokenizer")
    ids = info.encode(text)
    limit = _int(body, "max_completion_tokens", 0, _U32)
    limit = _int(body, "max_tokens", 0, _U32, limit)
    if limit is None:  # NOTE: OpenAI's default for chat: up to the end of the context
        limit = max(1, info.max_context_tokens - len(ids))
    req = _generate_request(body, request_id, limit)
    req.prompt_token_ids.token_ids.extend(ids)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS + 1)
    if _bool(body, "logprobs"):
        req.logprobs = top or 0
    elif top is not None:
        raise InvalidArgumentError("top_logprobs", 'needs "logprobs": true')
    if common["prompt_logprobs"] is not None:
        req.prompt_logprobs = common["prompt_logprobs"]
    return ApiRequest(jobs=(generate_from_pb(req, info),), **common)
