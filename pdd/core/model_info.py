"""What the gateway knows of the served model: vocabulary, context, end tokens, chat template."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_context_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str = ""
    # text → token ids; None when the model has no tokenizer (random test models).
    encode: Callable[[str], list[int]] | None = None
    # KV values one token holds: layers × kv heads × head dim × 2 (K and V); 0: unknown. With
    # the bytes of one value on the WAN, the link-aware router sizes a prompt's KV delta.
    kv_values_per_token: int = 0
    # Bytes of one value in the checkpoint's dtype (the engines' default KV dtype).
    kv_value_bytes: int = 4
