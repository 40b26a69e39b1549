"""Configuration of the token-flood stage (``pdd bench gateway``'s load)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.server.config import ServerConfig


@dataclass(frozen=True)
class TokenFloodConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # kvstore it registers with, as a MainDecode, so the gateway routes to it.
    kvstore: str = "127.0.0.1:50051"
    instance_id: str = "token-flood-0"
    # The address the gateway dials ("" = the bound one on 127.0.0.1).
    advertise: str = ""
    cluster: str = "remote"
    # Output tokens per Decode message: 1 is what a gateway that keeps up with a real
    # MainDecode receives (one message per token per request); more is a MainDecode's backlog.
    tokens_per_message: int = 1
    # Token ids are drawn below this (the gateway detokenizes them with its model's tokenizer).
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id: must be non-empty")
        if self.tokens_per_message < 1:
            raise ValueError(f"tokens_per_message: must be >= 1, got {self.tokens_per_message}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {self.vocab_size}")
