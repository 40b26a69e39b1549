"""What a chaos run's clients saw, measured: recorded streams in, numbers out (pure).

``check_stream`` folds one request's chunks by position (lost, duplicated, changed tokens);
``fault_row`` turns one fault's records into the table row ``pdd chaos`` prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdd.bench.chaos_config import MOMENTS


@dataclass(frozen=True)
class StreamCheck:
    """One request's stream, position by position."""

    # The output, each position's first receipt, up to the first missing position.
    tokens: tuple[int, ...]
    # Positions never received below the stream's expected length.
    lost: int
    # Receipts beyond the first of a position (a repeated position).
    duplicated: int
    # Repeated positions whose token differed from the first receipt.
    conflicting: int


def check_stream(chunks: Sequence[tuple[int, Sequence[int]]], expected: int | None) -> StreamCheck:
    """``chunks``: each message's (start_position, token_ids), in arrival order. ``expected``:
    how many tokens the stream should hold (a completed request's max_tokens); None: the
    highest received position bounds it (a failed request: its tail is not "lost")."""
    seen: dict[int, int] = {}
    duplicated = conflicting = 0
    for start, ids in chunks:
        if start < 0:
            raise ValueError(f"chunks: negative start_position {start}")
        for offset, tok in enumerate(ids):
            pos = start + offset
            if pos in seen:
                duplicated += 1
                conflicting += seen[pos] != tok
            else:
                seen[pos] = tok
    length = expected if expected is not None else (max(seen) + 1 if seen else 0)
    lost = sum(1 for pos in range(length) if pos not in seen)
    tokens = []
    for pos in range(length):
        if pos not in seen:
            break
        tokens.append(seen[pos])
    return StreamCheck(tuple(tokens), lost, duplicated, conflicting)


@dataclass
class StreamRecord:
    """What one request's client saw."""

    index: int
    request_id: str
    seeded: bool
    max_tokens: int
    chunks: list[tuple[int, list[int]]] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float | None = None
    # "OK" or the gRPC status code's name.
    status: str = ""
    message: str = ""
    main_decode_instance: str = ""
    migrations: int = 0

    @property
    def streamed(self) -> int:
        return sum(len(ids) for _, ids in self.chunks)

    def in_flight(self, at_s: float) -> bool:
        return self.start_s <= at_s and (self.end_s is None or self.end_s > at_s)


@dataclass(frozen=True)
class FaultRow:
    fault: str
    pipeline: str
    moment: str
    injected: bool
    in_flight: int
    requests: int
    completed: int
    failed: int
    # gRPC status name → how many requests failed with it.
    statuses: dict[str, int]
    lost: int
    duplicated: int
    conflicting: int
    identical_greedy: int
    greedy: int
    identical_seeded: int
    seeded: int
    # Requests (failed ones too) whose received tokens differ from the reference's.
    changed: int
    migrated: int
    recover_s: float | None
    # Σ kv_blocks_used over the engine instances: idle before the fault, after the drain.
    kv_blocks_before: int
    kv_blocks_after: int
    # (instance, request) pairs whose DescribeCache(request_id) still says it holds KV.
    requests_holding_kv: int

    def __post_init__(self) -> None:
        if self.completed + self.failed != self.requests:
            raise ValueError(
                f"completed: {self.completed} + failed {self.failed} != requests {self.requests}"
            )

    @property
    def clean(self) -> bool:
        return (
            self.injected
            and self.failed == 0
            and self.lost == self.duplicated == self.changed == 0
            and self.identical_greedy == self.greedy
            and self.identical_seeded == self.seeded
            and self.requests_holding_kv == 0
        )


def fault_row(
    fault: str,
    records: Sequence[StreamRecord],
    reference: dict[int, Sequence[int]],
    *,
    pipeline: str = "",
    injected_at_s: float | None = None,
    recover_s: float | None = None,
    kv_blocks_before: int = 0,
    kv_blocks_after: int = 0,
    requests_holding_kv: int = 0,
) -> FaultRow:
    """The table's row for one fault from what the clients recorded (``reference``: request
    index → the fault-free output)."""
    statuses: dict[str, int] = {}
    lost = duplicated = conflicting = changed = migrated = 0
    identical = {True: 0, False: 0}
    counts = {True: 0, False: 0}
    completed = 0
    for rec in records:
        ok = rec.status == "OK"
        check = check_stream(rec.chunks, rec.max_tokens if ok else None)
        lost += check.lost
        duplicated += check.duplicated
        conflicting += check.conflicting
        migrated += rec.migrations > 0
        ref = list(reference.get(rec.index, ()))
        got = list(check.tokens)
        changed += got != ref[: len(got)] or check.conflicting > 0
        counts[rec.seeded] += 1
        if ok:
            completed += 1
            identical[rec.seeded] += got == ref and check.lost == 0
        else:
            statuses[rec.status] = statuses.get(rec.status, 0) + 1
    in_flight = (
        sum(rec.in_flight(injected_at_s) for rec in records) if injected_at_s is not None else 0
    )
    return FaultRow(
        fault=fault,
        pipeline=pipeline or "routed",
        moment=MOMENTS.get(fault, ""),
        injected=injected_at_s is not None,
        in_flight=in_flight,
        requests=len(records),
        completed=completed,
        failed=len(records) - completed,
        statuses=dict(sorted(statuses.items())),
        lost=lost,
        duplicated=duplicated,
        conflicting=conflicting,
        identical_greedy=identical[False],
        greedy=counts[False],
        identical_seeded=identical[True],
        seeded=counts[True],
        changed=changed,
        migrated=migrated,
        recover_s=recover_s,
        kv_blocks_before=kv_blocks_before,
        kv_blocks_after=kv_blocks_after,
        requests_holding_kv=requests_holding_kv,
    )


HEADER = (
    "| fault | pipeline | in flight | completed | failed (status) | lost | dup | "
    "identical greedy | identical seeded | migrated | recover s | KV blocks idle → after | "
    "requests holding KV |"
)


def markdown_table(rows: Sequence[FaultRow]) -> str:
    lines = [HEADER, "|" + "---|" * 13]
    for r in rows:
        failed = str(r.failed)
        if r.statuses:
            failed += " (" + ", ".join(f"{k} {v}" for k, v in r.statuses.items()) + ")"
        recover = f"{r.recover_s:.2f}" if r.recover_s is not None else "never"
        fault = r.fault if r.injected else f"{r.fault} (not injected)"
        lines.append(
            f"| {fault} | {r.pipeline} | {r.in_flight} | {r.completed}/{r.requests} | {failed} | "
            f"{r.lost} | {r.duplicated} | {r.identical_greedy}/{r.greedy} | "
            f"{r.identical_seeded}/{r.seeded} | {r.migrated} | {recover} | "
            f"{r.kv_blocks_before} → {r.kv_blocks_after} | {r.requests_holding_kv} |"
        )
    return "\n".join(lines)
