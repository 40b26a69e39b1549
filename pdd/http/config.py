"""Configuration of the gateway's OpenAI-compatible HTTP server."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.server.tls import TlsConfig


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    # 0 = no HTTP server.
    port: int = 0
    # Bearer keys that /v1/* accepts; empty = no authentication. ``key:tenant`` also names the
    # key's tenant: once any key has one, every request's cache salt is its tenant's combined
    # with the salt it sent (``openai_convert.tenant_salt``), so tenants never share KV blocks or
    # hit predictions (a key without a tenant is the tenant ""). Keys cannot contain ":".
    api_keys: tuple[str, ...] = ()
    # Largest request body; larger ones get 413 before they are parsed.
    max_body_bytes: int = 8 * 2**20
    # The model id clients send and /v1/models lists; "" = the gateway's model spec.
    served_model_name: str = ""
    # Seconds in-flight HTTP requests get on shutdown.
    grace_s: float = 5.0
    # The gateway's TLS identity: with a certificate the API is HTTPS only (and with client auth,
    # mutual TLS), like its gRPC port; plaintext otherwise.
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"http_port: must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if any(not k or any(c.isspace() for c in k) for k in self.api_keys):
            raise ValueError("api_keys: a key must be non-empty and without whitespace")
        keys = [k.partition(":")[0] for k in self.api_keys]
        if any(not k for k in keys) or any(k.endswith(":") for k in self.api_keys):
            raise ValueError("api_keys: expected key or key:tenant, both non-empty")
        if any(":" in k.partition(":")[2] for k in self.api_keys):
            raise ValueError("api_keys: expected key or key:tenant, a tenant without ':'")
        if len(set(keys)) != len(keys):
            raise ValueError("api_keys: a key may be given once (with one tenant)")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")

    @property
    def keys(self) -> tuple[str, ...]:
        """The bearer keys, without their tenants."""
        return tuple(k.partition(":")[0] for k in self.api_keys)

    @property
    def tenants(self) -> dict[str, str]:
        """Key → its tenant ("" for a key without one); empty when no key names a tenant, and
        then cache salts pass as clients send them."""
        if not any(":" in k for k in self.api_keys):
            return {}
        return dict(k.partition(":")[::2] for k in self.api_keys)
