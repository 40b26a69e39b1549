"""What the load generator measured about one request (plain data, JSON round-trip).

Times are milliseconds. ``token_times_ms`` are arrival times of each output token
relative to the moment the request was sent (tokens delivered in one message
share a time); ``token_stages`` says which service produced each ("prefill",
"relay", "main_decode"). ``ttfdt_ms`` is the time to the first token a *decode*
stage produced (output position 1: prefill streams position 0 at once): what
the report calls TTFT, since its deployments show the user no token before
decoding starts, i.e. before the KV has crossed the link. ``itl_ms`` holds the gaps between consecutive messages that
carried tokens, as vLLM's ``bench serve`` counts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DECODE_STAGES = ("relay", "main_decode")
# How many tokens either side of the relay → MainDecode switch count as "around the handoff".
HANDOFF_WINDOW_TOKENS = 8


@dataclass
class RequestResult:
    request_id: str
    session_id: str = ""
    turn: int = 0
    # When the request was sent, relative to the start of the run.
    start_ms: float = 0.0
    prompt_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    token_times_ms: list[float] = field(default_factory=list)
    token_stages: list[str] = field(default_factory=list)
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    # "p-md" | "p-rld-md" | "md" | "" (unknown, e.g. on error)
    pipeline: str = ""
    handoff_mode: str = ""
    handoff_at_token: int = 0
    # Gap between the last relay token and the first main_decode token.
    handoff_gap_ms: float | None = None
    rld_tokens: int = 0
    md_tokens: int = 0
    predicted_hit: float | None = None
    actual_hit: float | None = None
    expected_hit: float | None = None
    wan_bytes: int = 0
    wan_transfer_ms: float = 0.0
    server_ttft_ms: float | None = None
    finish_reason: str = ""
    # gRPC status code name (e.g. "RESOURCE_EXHAUSTED") and message; None when it succeeded.
    error_code: str | None = None
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error_code is None

    @property
    def ttfdt_ms(self) -> float | None:
        """Time to the first decode-stage (relay or main_decode) token; None if there was none."""
        for t, stage in zip(self.token_times_ms, self.token_stages):
            if stage in DECODE_STAGES:
                return t
        return None

    @property
    def handoff_index(self) -> int | None:
        """Output index of MainDecode's first token after the relay's last (None: no switch)."""
        stages = self.token_stages
        return next(
            (
                i
                for i in range(1, len(stages))
                if stages[i - 1] == "relay" and stages[i] == "main_decode"
            ),
            None,
        )

    @property
    def handoff_window_ms(self) -> float | None:
        """The longest wait between tokens within ``HANDOFF_WINDOW_TOKENS`` of the relay → MainDecode
        switch: the stall a user could notice around the handoff, even if it is not at the switch
        itself (the relay's pacing moves tokens around it). None without a switch."""
        i, t = self.handoff_index, self.token_times_ms
        if i is None:
            return None
        lo, hi = max(1, i - HANDOFF_WINDOW_TOKENS), min(len(t) - 1, i + HANDOFF_WINDOW_TOKENS)
        return max(t[j] - t[j - 1] for j in range(lo, hi + 1))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping) -> RequestResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def write_records(records: Iterable[RequestResult], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_records(path: str | Path) -> list[RequestResult]:
    with open(path) as f:
        return [RequestResult.from_json(json.loads(line)) for line in f if line.strip()]


def records_path(result_path: str | Path) -> Path:
    """Where the per-request records of a RESULT file live: ``X.json`` → ``X.records.jsonl``."""
    p = Path(result_path)
    return p.with_name(p.stem + ".records.jsonl")
