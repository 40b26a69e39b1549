"""PDD → OpenAI JSON: results as OpenAI's response and stream-chunk bodies (choices, usage,
logprobs in the completions and chat shapes, echo and prompt logprobs); the requests they answer
are parsed by ``pdd.http.openai_convert``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdd.core.sampling_params import Logprob
from pdd.http.openai_convert import CHAT, ApiRequest


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` (None: unknown, left out) are the prompt tokens served
    from a prefix cache, as ``prompt_tokens_details.cached_tokens``."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _envelope(r: ApiRequest, chunk: bool) -> dict[str, Any]:
    obj = r.kind + (".chunk" if chunk and r.kind == CHAT else "")
    return {"id": r.id, "object": obj, "created": r.created, "model": r.model}


def logprobs_body(
    r: ApiRequest,
    items: Sequence[tuple[int, Logprob | None]],
    token_text: Callable[[int], str],
    text_offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice (or chunk) for its tokens ``items`` = (token id, Logprob).

    Chat: ``content`` entries with ``token``, ``logprob``, ``bytes`` and ``top_logprobs``.
    Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top k and always the
    sampled token, so up to k + 1) and ``text_offset`` (from ``text_offset``, in token strings);
    a None Logprob (echo's first prompt token, which nothing predicts) is null in both lists.
    """
    if r.kind == CHAT:

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(t, lp.logprob), "top_logprobs": [entry(tt, v) for tt, v in lp.top]}
                for t, lp in items
            ]
        }
    tokens = [token_text(t) for t, _ in items]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    top = [
        None
        if lp is None
        else {**{token_text(tt): v for tt, v in lp.top}, token_text(t): lp.logprob}
        for t, lp in items
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in items],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def echo_items(
    r: ApiRequest, prompt_ids: Sequence[int], scores: Sequence[Logprob]
) -> list[tuple[int, Logprob | None]]:
    """The prompt's (token, Logprob) for an echoed choice's logprobs: the first token's None, the
    rest with the request's top ``logprobs`` (the engine may have scored more for
    ``prompt_logprobs``)."""
    k = r.job.sampling.logprobs or 0
    trimmed = [lp if len(lp.top) <= k else replace(lp, top=lp.top[:k]) for lp in scores]
    return list(zip(prompt_ids, [None, *trimmed]))


def prompt_logprobs_body(
    prompt_ids: Sequence[int], scores: Sequence[Logprob], k: int, token_text: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: null for the first prompt token, then per token
    ``{token id: {logprob, rank, decoded_token}}`` for the token itself and the top ``k``."""
    out: list[dict[str, Any] | None] = [None]
    for t, lp in zip(prompt_ids[1:], scores):
        entry = {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text(t)}}
        for rank, (tt, v) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(tt), {"logprob": v, "rank": rank, "decoded_token": token_text(tt)})
        out.append(entry)
    return out


def _choice(
    r: ApiRequest,
    text: str,
    finish: str | None,
    token_ids: Sequence[int] | None,
    chunk: bool,
    role: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    if r.kind == CHAT:
        body: dict[str, Any] = {"index": index}
        if chunk:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            body["delta"] = delta
        else:
            body["message"] = {"role": "assistant", "content": text}
    else:
        body = {"index": index, "text": text}
    body["logprobs"] = logprobs
    body["finish_reason"] = finish
    if r.return_token_ids and token_ids is not None:
        body["token_ids"] = list(token_ids)
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


@dataclass(frozen=True)
class Choice:
    text: str
    finish: str
    token_ids: Sequence[int]
    logprobs: dict[str, Any] | None = None  # ``logprobs_body`` when the request asked for them
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # ``prompt_logprobs_body``


def response_body(
    r: ApiRequest,
    choices: Sequence[Choice],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The whole (non-streamed) response; ``choices`` in index order, usage over all of them."""
    return {
        **_envelope(r, False),
        "choices": [
            _choice(
                r,
                c.text,
                c.finish,
                c.token_ids,
                False,
                index=i,
                logprobs=c.logprobs,
                prompt_logprobs=c.prompt_logprobs,
            )
            for i, c in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def chunk_body(
    r: ApiRequest,
    text: str = "",
    finish: str | None = None,
    token_ids: Sequence[int] | None = None,
    *,
    role: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice ``index``; ``role`` marks chat's first chunk of a choice (OpenAI
    sends the role once)."""
    out = {
        **_envelope(r, True),
        "choices": [_choice(r, text, finish, token_ids, True, role, index, logprobs)],
    }
    if r.include_usage:
        out["usage"] = None
    return out


def usage_chunk(
    r: ApiRequest, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {
        **_envelope(r, True),
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish_reason for the engine's (stop: EOS/stop token/stop string; length)."""
    return reason if reason in ("stop", "length") else "stop"
