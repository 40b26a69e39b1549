"""Incremental detokenization: token ids in, text deltas out.

Byte-level BPE can split one character across tokens, so the text of a
prefix is not always a prefix of the text; a delta is released only once
the decoded tail no longer ends in a replacement character, and always as
the difference against the text already released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Re-decode at most this many trailing tokens per step (bounded cost per token).
_WINDOW = 8


class Detokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str] | None) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this are final and their text released
        self._released = ""  # text released for tokens [prefix_offset:]

    def add(self, token_ids: Sequence[int]) -> str:
        if self._decode is None:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix_offset :])
        if text.endswith("\ufffd"):
            return ""  # NOTE: an incomplete UTF-8 sequence; wait for the next token
        delta = text[len(self._released) :] if text.startswith(self._released) else text
        self._released = text
        if len(self._ids) - self._prefix_offset > _WINDOW:
            # Freeze everything but the last few tokens.
            self._prefix_offset = len(self._ids) - _WINDOW // 2
            self._released = self._decode(self._ids[self._prefix_offset :])
        return delta
