"""What the simulator knows about hardware: step-time profiles of the chips, read from JSON.

A profile file (``pdd/bench/profiles/*.json``) gives every number with where it comes from::

    {"name": "...", "kv_bytes_per_token": {"value": 40016, "source": "..."},
     "kv_wire_dtype": {"value": "fp8", "source": "..."},
     "kv_wire_ratio": {"value": 1.0, "source": "..."},
     "chips": {"flagship": {"prefill_tokens_per_s": {"value": ..., "source": "..."}, ...}},
     "link": {"wan_gbps": {...}, ...}}

The KV size is the input every WAN figure scales with, so it is stated in three parts: the bytes
one token's KV holds in the engine's cache (``kv_bytes_per_token``: the model's layers, heads and
cache dtype), the dtype it crosses the links in (``kv_wire_dtype``) and the bytes on the wire per
byte held (``kv_wire_ratio``: 1 = sent as stored, 0.5 = fp32 sent as bf16 or fp16 as fp8).
``SimConfig.kv_bytes_per_token`` overrides the first for a run (the report comparison's column b).

``pdd bench calibrate`` writes one for this machine; ``report.json`` holds the report's hardware.
The cost model of one chip (an *instance*: the unit that runs one batch):
  prefill step    overhead + Σ_chunks n / rate × (1 + (cached + n/2) / attention_tokens)
                  (the attention term: per-token cost grows with the context it attends to)
  decode step     step_ms + ms_per_seq × batch + ms_per_mtok × (context tokens in the batch) / 1e6
                  (+ the profile's ``md_`` / ``relay_stream_ms_per_step``: the served stage's cost)
  extend by k     a prefill chunk of k tokens on the decode chip: its step + k × extend_ms_per_token
                  × (1 + (cached + k/2) / extend_attention_tokens) (a calibrated chip; the report's
                  figure, measured at its own context, has no attention term)
  KV budget       ``kv_budget_tokens`` of KV per instance: running requests and the radix cache
                  share it, so the batch and the hit rate are both bounded by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

PROFILES = Path(__file__).with_name("profiles")
# Profile-level numbers besides the KV size, each with its source like every other.
PROFILE_NUMBERS = (
    "kv_wire_dtype",
    "kv_wire_ratio",
    "request_overhead_ms",
    "md_request_overhead_ms",
    "md_stream_ms_per_step",
    "relay_stream_ms_per_step",
    "prefill_stack_factor",
)


@dataclass(frozen=True)
class ChipProfile:
    prefill_tokens_per_s: float
    prefill_overhead_ms: float
    # Context length at which a prefilled token costs twice as much (attention over the prefix).
    prefill_attention_tokens: float
    # New tokens one prefill step takes (chunked prefill's budget).
    prefill_chunk_tokens: int
    decode_step_ms: float
    decode_ms_per_seq: float
    decode_ms_per_mtok: float
    extend_ms_per_token: float
    kv_budget_tokens: int
    max_batch: int
    # Context length at which an extended token costs twice ``extend_ms_per_token`` (attention
    # over the cached prefix); 0: the per-token figure already holds at the context it is used
    # at (the report's, measured at its own context).
    extend_attention_tokens: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v < 0:
                raise ValueError(f"{f.name}: must be >= 0, got {v}")
        for name in (
            "prefill_tokens_per_s",
            "prefill_attention_tokens",
            "prefill_chunk_tokens",
            "kv_budget_tokens",
            "max_batch",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")

    def prefill_ms(self, tokens: float, cached: float) -> float:
        """One chunk of ``tokens`` new tokens after ``cached`` tokens of context (no overhead)."""
        return (
            tokens
            / self.prefill_tokens_per_s
            * 1e3
            * (1 + (cached + tokens / 2) / self.prefill_attention_tokens)
        )

    def decode_ms(self, batch: int, context_tokens: float) -> float:
        if not batch:
            return 0.0
        return (
            self.decode_step_ms
            + self.decode_ms_per_seq * batch
            + self.decode_ms_per_mtok * context_tokens / 1e6
        )

    def extend_chunk_ms(self, tokens: float, cached: float) -> float:
        """``tokens`` known tokens extended after ``cached`` tokens of context, inside a decode
        step (a local prefill's chunk, a handoff's extension): what they add to the step."""
        grow = self.extend_attention_tokens
        return tokens * self.extend_ms_per_token * (1 + (cached + tokens / 2) / grow if grow else 1)

    def extend_ms(self, k: int) -> float:
        """Extend-decode of ``k`` known tokens alone: one step plus ``k`` tokens' worth."""
        return self.decode_ms(1, 0) + k * self.extend_ms_per_token

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> ChipProfile:
        """This chip ``prefill``× as fast at prefill and ``decode``× at decode (a lopsided chip)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["prefill_tokens_per_s"] *= prefill
        for name in ("decode_step_ms", "decode_ms_per_seq", "decode_ms_per_mtok"):
            d[name] /= decode
        d["extend_ms_per_token"] /= decode
        return ChipProfile(**d)


@dataclass(frozen=True)
class LinkProfile:
    wan_gbps: float
    wan_delay_ms: float
    pool_streams: int
    fast_gbps: float

    def __post_init__(self) -> None:
        for name in ("wan_gbps", "pool_streams", "fast_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.wan_delay_ms < 0:
            raise ValueError(f"wan_delay_ms: must be >= 0, got {self.wan_delay_ms}")


@dataclass(frozen=True)
class Profile:
    name: str
    kv_bytes_per_token: int
    chips: dict[str, ChipProfile]
    link: LinkProfile
    # Where each number came from: "chips.flagship.decode_step_ms" → source text.
    sources: dict[str, str]
    kv_wire_dtype: str = "as-stored"
    kv_wire_ratio: float = 1.0
    # What the serving stack itself adds to every request before a stage computes (gateway,
    # kvstore's prediction, the gRPC hops, the processes' event loops): measured on the testbed.
    request_overhead_ms: float = 0.0
    # The same for pipeline MD (no prefill stage, no KV transfer: fewer hops).
    md_request_overhead_ms: float = 0.0
    # What a served decode stage adds to each of its steps beyond the bare engine's step: the
    # serving loop handing the step's tokens to the event loop and out as gRPC messages, and the
    # processes sharing its core (on the testbed MainDecode's core also runs the WAN emulator that
    # forwards its tokens; the relay's runs prefill, the gateway and the bench client, which
    # handle every token of every request).
    md_stream_ms_per_step: float = 0.0
    relay_stream_ms_per_step: float = 0.0
    # A served prefill's time ÷ the bare engine's for the same tokens: the prefill stage also
    # exports each computed chunk's KV into its transfer formats and hands it to the pushes.
    prefill_stack_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token: must be > 0, got {self.kv_bytes_per_token}")
        for name in PROFILE_NUMBERS[2:]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 < self.kv_wire_ratio <= 1:
            raise ValueError(f"kv_wire_ratio: must be in (0, 1], got {self.kv_wire_ratio}")

    @property
    def wire_bytes_per_token(self) -> float:
        """Bytes one token's KV puts on a link (fast or WAN)."""
        return self.kv_bytes_per_token * self.kv_wire_ratio

    def chip(self, name: str) -> ChipProfile:
        if name not in self.chips:
            raise ValueError(
                f"chip: {name!r} not in profile {self.name!r} ({', '.join(self.chips)})"
            )
        return self.chips[name]


def _values(d: dict, where: str, sources: dict[str, str]) -> dict:
    out = {}
    for k, v in d.items():
        if not isinstance(v, dict) or "value" not in v:
            raise ValueError(f"{where}.{k}: expected {{'value': ..., 'source': ...}}")
        if not str(v.get("source", "")).strip():
            raise ValueError(f"{where}.{k}: a number without a source")
        out[k] = v["value"]
        sources[f"{where}.{k}"] = v["source"]
    return out


def parse_profile(d: dict) -> Profile:
    """A profile from its JSON object; a missing field or source raises ``ValueError`` naming it."""
    sources: dict[str, str] = {}
    try:
        kv = _values({"kv_bytes_per_token": d["kv_bytes_per_token"]}, "profile", sources)
        wire = {k: d[k] for k in PROFILE_NUMBERS}
        kv.update(_values(wire, "profile", sources))
        chips = {
            name: ChipProfile(**_values(c, f"chips.{name}", sources))
            for name, c in d["chips"].items()
            if not name.startswith("_")
        }
        link = LinkProfile(**_values(d["link"], "link", sources))
    except KeyError as e:
        raise ValueError(f"profile: missing {e.args[0]}") from None
    except TypeError as e:  # an unknown or missing dataclass field
        raise ValueError(f"profile: {e}") from None
    return Profile(
        str(d.get("name", "")),
        int(kv["kv_bytes_per_token"]),
        chips,
        link,
        sources,
        kv_wire_dtype=str(kv["kv_wire_dtype"]),
        kv_wire_ratio=float(kv["kv_wire_ratio"]),
        request_overhead_ms=float(kv["request_overhead_ms"]),
        md_request_overhead_ms=float(kv["md_request_overhead_ms"]),
        md_stream_ms_per_step=float(kv["md_stream_ms_per_step"]),
        relay_stream_ms_per_step=float(kv["relay_stream_ms_per_step"]),
        prefill_stack_factor=float(kv["prefill_stack_factor"]),
    )


def load_profile(name_or_path: str | Path) -> Profile:
    """``report`` / ``testbed`` (the files beside this module) or a path to a profile JSON."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILES / f"{name_or_path}.json"
    if not p.is_file():
        raise ValueError(f"profile: no file {p}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile: {p} is not JSON ({e.msg} at line {e.lineno})") from None
    return parse_profile(d)
