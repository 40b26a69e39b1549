"""What MainDecode takes from its peers for a request it holds, checked before it touches the
request (``pdd.serving.main_decode``): the KV push's header and commit (prefill, through
``KvReceiver.check``) and each token-handoff batch (the relay, or the gateway taking over).

A push is the KV a request waits for, or it is refused: its header names a P-MD / P-RLD-MD
request accepted here that has no KV yet, starts at the tokens MainDecode locked
(``Accepted.cached_tokens``), ends at the prompt's end, repeats the prompt and the cache salt,
and is laid out for this model; its commit carries prefill's one first token, inside the
vocabulary.

Handoff batches of one request fix its outputs in order: a batch starts at or before the end of
what was handed over so far (no gap) and repeats what it overlaps (a handed-over output is never
rewritten: the client has seen it); once the final batch made MainDecode speak, a batch may only
repeat outputs MainDecode holds (a retransmit, acknowledged again and nothing more).

Whatever is refused leaves the request as it was. NOTE: none of this authenticates a peer: a push
or a batch that repeats exactly what the real sender would send cannot be told from it (the
links between the services are mTLS-guarded: README, "TLS").
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from pdd.core.pipeline import Pipeline
from pdd.engine.model_config import ModelConfig
from pdd.kv.transfer import Commit, TransferHeader
from pdd.serving.main_decode_life import DecodeLife

# The engine's KV axes (``pdd.serving.kv_bridge``): a push's layout must name every one.
_KV_AXES = frozenset({"layer", "kv", "token", "head", "dim"})


def check_push(life: DecodeLife | None, item: TransferHeader | Commit, model: ModelConfig) -> None:
    """Refuse a new KV transfer's header, or its commit, that is not what ``life`` waits for."""
    field = "header" if isinstance(item, TransferHeader) else "commit"
    rid = item.request_id
    if life is None:
        raise NotFoundError(f"{field}.request_id: {rid!r} is not decoding here")
    job = life.job
    if job.pipeline is Pipeline.MD or job.resume_token_ids:
        raise FailedPreconditionError(
            f"{field}.request_id: {rid!r} prefills here ({job.pipeline.value}); it takes no push"
        )
    if life.kv_ready.is_set():
        raise FailedPreconditionError(f"{field}.request_id: {rid!r} already holds its KV")
    if life.cached_tokens is None:
        raise FailedPreconditionError(f"{field}.request_id: {rid!r} is not accepted here yet")
    if isinstance(item, TransferHeader):
        _check_header(life, item, model)
    else:
        _check_commit(item, model.vocab_size)


def _check_header(life: DecodeLife, h: TransferHeader, model: ModelConfig) -> None:
    job, n = life.job, len(life.job.prompt_token_ids)
    if h.start_token != life.cached_tokens:
        raise InvalidArgumentError(
            "header.start_token",
            f"must be {life.cached_tokens}, the prompt tokens MainDecode holds; got {h.start_token}",
        )
    if h.start_token + h.num_tokens != n:
        raise InvalidArgumentError(
            "header.num_tokens",
            f"must be {n - h.start_token} (to the prompt's end, {n}); got {h.num_tokens}",
        )
    if h.token_ids != job.prompt_token_ids:
        raise InvalidArgumentError("header.token_ids", "must be the request's prompt")
    if h.cache_salt != job.cache_salt:
        raise InvalidArgumentError("header.cache_salt", "must be the request's cache salt")
    theirs = (h.layout.num_layers, h.layout.num_kv_heads, h.layout.head_dim)
    ours = (model.num_layers, model.num_kv_heads, model.head_dim)
    if theirs != ours:
        raise InvalidArgumentError(
            "header.layout", f"(layers, kv heads, head dim) {theirs} is not this model's {ours}"
        )
    if set(h.layout.axes.split(",")) != _KV_AXES:
        raise InvalidArgumentError(
            "header.layout.axes", f"must name each of {sorted(_KV_AXES)}; got {h.layout.axes!r}"
        )


def _check_commit(c: Commit, vocab: int) -> None:
    ids = c.output_token_ids
    if len(ids) != 1:
        raise InvalidArgumentError(
            "commit.output_token_ids", f"must be prefill's one first token; got {len(ids)}"
        )
    if not 0 <= ids[0] < vocab:
        raise InvalidArgumentError(
            "commit.output_token_ids", f"token id {ids[0]} is outside the vocabulary ({vocab})"
        )


def check_handoff(life: DecodeLife, start: int, token_ids: Sequence[int]) -> bool:
    """Refuse a batch that would leave a gap or rewrite a handed-over output; True when the
    handoff is over already and the batch only repeats what MainDecode holds (acknowledge it,
    change nothing)."""
    rid = life.job.request_id
    if life.handoff_end is not None:
        if life.agrees(start, token_ids):
            return True
        raise FailedPreconditionError(
            f"request_id: {rid!r} was handed over at output {life.handoff_end} and MainDecode "
            "speaks from there; a later batch may only repeat its outputs"
        )
    if start > life.handed:
        raise FailedPreconditionError(
            f"start_position: {start} leaves a gap after the {life.handed} outputs of {rid!r} "
            "handed over"
        )
    fixed = token_ids[: max(0, life.handed - start)]
    if not life.agrees(start, fixed):
        at = start + next(i for i, t in enumerate(fixed) if life.outputs.get(start + i) != t)
        raise FailedPreconditionError(
            f"token_ids: disagree at output {at} with what was handed over for {rid!r}"
        )
    return False
