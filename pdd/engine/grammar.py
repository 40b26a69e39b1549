"""Structured output: a request's grammar masks the tokens it may sample (llguidance).

A grammar is llguidance's JSON text (``grammar_from_json_schema`` makes one from
a JSON schema; Lark and regex grammars work too). Each request with one gets a
matcher that has consumed exactly its outputs so far: sampled tokens, and tokens
another stage produced (``append_tokens`` of a handoff) — so every engine masks
the same way at the same position and a handed-over request stays in its
grammar. A rollback (MainDecode's speculative tokens replaced) rolls the matcher
back too.

NOTE: llguidance needs no torch for the grammar itself, so the gateway validates
grammars with ``validate`` without loading torch; ``mask_rows`` is the engine's.
"""

from __future__ import annotations

import json
from typing import Any

JSON_DEFAULTS = {
    "whitespace_flexible": False
}  # compact JSON: small models wander in free whitespace


def validate(grammar: str) -> str:
    """'' when ``grammar`` compiles, else llguidance's message."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def from_json_schema(schema: Any) -> str:
    """The grammar of JSON text that follows ``schema`` (a dict, or a JSON string); ValueError if invalid."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        schema = json.loads(schema)
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    error = validate(grammar)
    if error:
        raise ValueError(error)
    return grammar


class Grammars:
    """One engine's grammar support: its tokenizer as llguidance sees it (built on first use).

    ``tokenizer``: an llguidance ``LLTokenizer`` to use as it is instead of one built from
    ``hf_tokenizer`` (e.g. a byte-level one in a test).
    """

    def __init__(self, hf_tokenizer: Any | None, tokenizer: Any | None = None) -> None:
        self._hf = hf_tokenizer
        self._tokenizer = tokenizer

    def matcher(self, grammar: str):
        """A fresh matcher for ``grammar``; ValueError if the model has no tokenizer or the grammar is bad."""
        if self._hf is None and self._tokenizer is None:
            raise ValueError("grammar: the model has no tokenizer, so it cannot follow a grammar")
        from llguidance import LLMatcher

        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf)
        matcher = LLMatcher(
            self._tokenizer, grammar
        )  # NOTE: compiles once; a bad grammar is an error state
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        return matcher

    def mask_rows(self, logits, rows: list[tuple[int, Any]]) -> None:
        """Set to -inf, in place, every logit of row ``i`` its matcher does not allow next."""
        import torch

        # NOTE: not llguidance.torch: importing it runs torch.compile's machinery (seconds, and its
        # apply compiles on first call); the mask is one bit per token, unpacked here.
        vocab = self._tokenizer.vocab_size
        bitmask = torch.stack(
            [
                torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
                for _, matcher in rows
            ]
        )  # [R, ceil(V / 32)], bit t of word t // 32 = allowed
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [R, W, 32]
        allowed = bits.reshape(len(rows), -1)[:, :vocab].bool().to(logits.device)
        n = min(vocab, logits.shape[-1])
        for j, (i, _) in enumerate(rows):
            logits[i, :n].masked_fill_(~allowed[j, :n], -torch.inf)
            logits[
                i, n:
            ] = -torch.inf  # ids beyond the tokenizer's vocabulary (padding) never come out


# --- one request's matcher as its outputs change (the engine calls these) ---------------------


def advance_grammar(matcher: Any, request_id: str, token: int, reason: str | None) -> str | None:
    """Feed a sampled ``token`` to the request's matcher; returns the finish reason."""
    if not matcher.consume_token(token):
        raise RuntimeError(
            f"{request_id}: sampled token {token} outside its grammar ({matcher.get_error()})"
        )
    if reason is None and matcher.is_stopped():
        return "stop"  # the grammar is complete: nothing more may follow
    return reason


def follow_grammar(matcher: Any, request_id: str, dropped: list[int], added: list[int]) -> bool:
    """Extend: roll the matcher back over ``dropped`` outputs and through ``added``.

    Returns whether the grammar is then complete. ValueError (matcher unchanged) if ``added``
    leaves the grammar.
    """
    if dropped and not matcher.rollback(len(dropped)):
        raise RuntimeError(f"{request_id}: the grammar could not roll back {len(dropped)} tokens")
    accepted = matcher.validate_tokens(added)
    if accepted < len(added):
        if dropped:
            matcher.consume_tokens(dropped)
        raise ValueError(
            f"token_ids[{accepted}] (token {added[accepted]}) is not allowed by the request's "
            "grammar"
        )
    if added and not matcher.consume_tokens(added):
        raise RuntimeError(f"{request_id}: the grammar refused tokens it had validated")
    return matcher.is_stopped()
