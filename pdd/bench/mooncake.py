"""Mooncake-format trace replay, mapped onto token sequences.

A Mooncake trace is JSONL, one request a line: ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` — one id per 512-token
block of the prompt, where equal ids mean equal prefix content. We turn each
line into the generator's ``TraceRequest``:

  * each hash id becomes a deterministic block of ``block_tokens`` token ids
    (seeded by ``(seed, hash_id)``), so shared ids give literally shared blocks;
  * lengths are scaled by ``block_tokens / source_block_tokens`` (512 → 16 on a
    CPU testbed) and the prompt is the blocks' concatenation cut to that length;
    a trace whose ids cover too few tokens is padded with request-unique tokens;
  * ``max_tokens`` is ``output_length / output_scale``; timestamps are divided by
    ``time_scale`` (2 = twice as fast);
  * ``expected_hit`` is the exact longest prefix shared with any earlier request
    (Mooncake has no outputs, so prompts only). Every request is its own session.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdd.bench.trace import TraceRequest, describe, json_line, write_trace


@dataclass(frozen=True)
class MooncakeConfig:
    block_tokens: int = 16
    source_block_tokens: int = 512
    output_scale: float = 1.0
    time_scale: float = 1.0
    vocab_low: int = 100
    vocab_high: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_tokens", "source_block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("output_scale", "time_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(
                f"vocab_high: need 0 <= vocab_low < vocab_high, got [{self.vocab_low}, {self.vocab_high})"
            )

    def prompt_length(self, input_length: int) -> int:
        return max(1, int(round(input_length * self.block_tokens / self.source_block_tokens)))

    def max_tokens(self, output_length: int) -> int:
        return max(1, int(round(output_length / self.output_scale)))


def block_tokens(hash_id: int, cfg: MooncakeConfig) -> list[int]:
    """The token ids standing for one hash block: a pure function of (seed, hash id)."""
    rng = np.random.default_rng([cfg.seed, int(hash_id) & 0xFFFFFFFFFFFFFFFF])
    return rng.integers(cfg.vocab_low, cfg.vocab_high, size=cfg.block_tokens).tolist()


MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_mooncake(path: str | Path) -> list[dict]:
    """The trace's rows, each checked for the four fields (``ValueError``: file, line, field)."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json_line(line, path, n)
            for key in MOONCAKE_FIELDS:
                if key not in row:
                    hint = (
                        " (this is a PDD trace: `pdd bench --trace` takes it as it is)"
                        if "prompt_token_ids" in row
                        else ""
                    )
                    raise ValueError(f"{path}:{n}: {key}: missing{hint}")
            problem = _row_problem(row)
            if problem:
                raise ValueError(f"{path}:{n}: {problem}")
            rows.append(row)
    return rows


def _row_problem(row: Mapping) -> str:
    """What is wrong with one row's four fields ("" when nothing): the field, then why."""

    def integer(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(row["timestamp"], int | float) or isinstance(row["timestamp"], bool):
        return f"timestamp: expected a number of ms, got {row['timestamp']!r}"
    for key in ("input_length", "output_length"):
        if not integer(row[key]) or row[key] < 0:
            return f"{key}: expected an integer >= 0, got {row[key]!r}"
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(integer(h) for h in ids):
        return f"hash_ids: expected a list of integers, got {ids!r}"[:200]
    return ""


def to_requests(rows: Iterable[Mapping], cfg: MooncakeConfig) -> list[TraceRequest]:
    """Rows → requests in timestamp order (stable), with token prompts and exact expected hits."""
    indexed = sorted(enumerate(rows), key=lambda ir: float(ir[1]["timestamp"]))
    seen: dict[
        tuple, int
    ] = {}  # chained block key → most tokens of that block any earlier prompt held
    out: list[TraceRequest] = []
    bt = cfg.block_tokens
    for index, row in indexed:
        length = cfg.prompt_length(int(row["input_length"]))
        ids = [int(h) for h in row["hash_ids"]][: math.ceil(length / bt)]
        prompt: list[int] = []
        for h in ids:
            prompt.extend(block_tokens(h, cfg))
        if len(prompt) < length:  # too few ids: unique filler, never shared
            rng = np.random.default_rng([cfg.seed, 1 << 32, index])
            prompt.extend(
                rng.integers(cfg.vocab_low, cfg.vocab_high, size=length - len(prompt)).tolist()
            )
        del prompt[length:]
        matched, key, live = 0, (), True
        for j, h in enumerate(ids):
            key = (key, h) if j else (h,)
            covered = min(bt, length - j * bt)
            if live:
                common = min(seen.get(key, 0), covered)
                matched += common
                live = common == bt
            seen[key] = max(seen.get(key, 0), covered)
        rid = f"mc-{index:06d}"
        out.append(
            TraceRequest(
                request_id=rid,
                session_id=rid,
                timestamp_ms=round(float(row["timestamp"]) / cfg.time_scale, 3),
                prompt_token_ids=prompt,
                max_tokens=cfg.max_tokens(int(row["output_length"])),
                expected_hit=round(matched / length, 6),
            )
        )
    return out


def load_mooncake(path: str | Path, cfg: MooncakeConfig | None = None) -> list[TraceRequest]:
    return to_requests(read_mooncake(path), cfg or MooncakeConfig())


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd trace mooncake IN.jsonl --out OUT.jsonl [--block-tokens 16] ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["mooncake"]:
        argv = argv[1:]
    d = MooncakeConfig()
    p = argparse.ArgumentParser(
        prog="pdd trace mooncake", description="Map a Mooncake trace onto tokens."
    )
    p.add_argument("trace", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--block-tokens", type=int, default=d.block_tokens, help="tokens per hash block here"
    )
    p.add_argument("--source-block-tokens", type=int, default=d.source_block_tokens)
    p.add_argument("--output-scale", type=float, default=d.output_scale)
    p.add_argument(
        "--time-scale", type=float, default=d.time_scale, help="2 = replay twice as fast"
    )
    p.add_argument("--vocab-low", type=int, default=d.vocab_low)
    p.add_argument("--vocab-high", type=int, default=d.vocab_high)
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    try:
        cfg = MooncakeConfig(
            block_tokens=a.block_tokens,
            source_block_tokens=a.source_block_tokens,
            output_scale=a.output_scale,
            time_scale=a.time_scale,
            vocab_low=a.vocab_low,
            vocab_high=a.vocab_high,
            seed=a.seed,
        )
    except ValueError as e:
        p.error(str(e))
    reqs = load_mooncake(a.trace, cfg)
    if not reqs:
        raise ValueError(f"{a.trace}: no requests")
    write_trace(reqs, a.out)
    print(f"{a.out}: {describe(reqs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
