"""The token-flood stage's tokens (``services.token_flood``, ``pdd bench gateway``): a fixed
function of the position, so a client checks every token it was streamed without a reference."""

from __future__ import annotations


def token_at(position: int, vocab_size: int) -> int:
    return (position * 7 + 3) % vocab_size
