"""Configuration of the gateway service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.core.model_info import ModelInfo
from pdd.http.config import HttpConfig
from pdd.routing.policy import RoutingConfig
from pdd.server.config import ServerConfig
from pdd.serving.admission import DEFAULT_MAX_IN_FLIGHT
from services.stack_defaults import KVSTORE_ADDRESS, MODEL


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    kvstore_address: str = KVSTORE_ADDRESS
    # Model spec (name, path or tiny:SEED); the gateway loads only its tokenizer and config.
    model: str = MODEL
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # The OpenAI-compatible HTTP API (port 0: off).
    http: HttpConfig = field(default_factory=HttpConfig)
    stage_timeout_s: float = 600.0
    # Deadline of each kvstore call; past it (or kvstore unreachable) the request is routed from
    # the last known instances without predicted hits (pdd.serving.instance_view).
    index_timeout_s: float = 1.0
    # Seed of the router's tie-breaks (None: nondeterministic).
    seed: int | None = None
    # How many times one request may move to another MainDecode when its MainDecode or
    # prefill is lost mid-request (0: never; the request fails with the stage's error).
    max_migrations: int = 2
    # How long a P-MD request's first token may wait for MainDecode's KV (a partitioned or
    # stalled WAN) before the request is re-routed through a relay, which finishes it (0: never).
    kv_deadline_s: float = 30.0
    # Requests generated at once; beyond, the client gets RESOURCE_EXHAUSTED (HTTP 429) at once.
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    # The bound on requests in flight follows the latency the stack adds when it queues (an
    # adaptive concurrency limit, max_in_flight its ceiling); False: max_in_flight alone.
    adaptive_in_flight: bool = True
    # How long a request finding the bound reached may wait for a place (first come first
    # served, while the line moves) before it is refused; 0: refused at once. NOTE: off by
    # default — measured under a 5x burst, waiting raised the refusals' and the accepted
    # requests' latency and lowered goodput (docs/operations.md).
    admission_wait_s: float = 0.0
    # Bytes of one KV value on the WAN (prefill's --wan-dtype); 0: the model's dtype. Sizes the
    # KV delta in the link-aware router's transfer estimate (compression is not counted).
    wan_kv_value_bytes: int = 0
    # Every request to one MainDecode on one shared DecodeMany stream, each engine step's tokens
    # for all of them in one message; False: a Decode call (and a message per token) per request.
    shared_decode_stream: bool = True

    def __post_init__(self) -> None:
        if ":" not in self.kvstore_address:
            raise ValueError(f"kvstore_address: expected host:port, got {self.kvstore_address!r}")
        if self.stage_timeout_s <= 0:
            raise ValueError(f"stage_timeout_s: must be positive, got {self.stage_timeout_s}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {self.max_migrations}")
        if self.kv_deadline_s < 0:
            raise ValueError(f"kv_deadline_s: must be >= 0, got {self.kv_deadline_s}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {self.max_in_flight}")
        if self.admission_wait_s < 0:
            raise ValueError(f"admission_wait_s: must be >= 0, got {self.admission_wait_s}")
        if self.wan_kv_value_bytes < 0:
            raise ValueError(f"wan_kv_value_bytes: must be >= 0, got {self.wan_kv_value_bytes}")
        if self.index_timeout_s <= 0:
            raise ValueError(f"index_timeout_s: must be positive, got {self.index_timeout_s}")

    def kv_bytes_per_token(self, info: ModelInfo) -> int:
        """KV bytes one prompt token takes on the WAN (0: unknown)."""
        return info.kv_values_per_token * (self.wan_kv_value_bytes or info.kv_value_bytes)
