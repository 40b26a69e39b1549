"""``pdd bench served``'s budget table: where a round's time goes, hop by hop, against the target.

A round serves ``n`` prompts at once and lasts about as long as its requests'

    TTFT                 admission, prefill's step, the first token out
  + handoff              first token → second: in P-MD, prefill's KV export, the WAN push and
                         MainDecode's import before its first step; one engine step in-process
  + decode × (L − 2)     the interval per token from the second token to the last
  + tail                 last token → end of stream

each read off the client's token times (P50 over the contender's requests at that ``n``), the
same way for every contender. The target (issue 19: served ≥ 1.2× vLLM's server) fixes a
round's budget, ``n × L / (1.2 × vLLM's tok/s)``; what is left of it per decode token, with the
contender's TTFT, handoff and tail as they are, is its per-token budget — the decode interval
it would need. For the stack, its services' logs add the hops inside the handoff: prefill's
step, the KV push (queued, then on the wire), MainDecode's import (with the first token's
append), each a P50 over the same requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdd.bench.metrics import percentile
from pdd.bench.record import RequestResult

TARGET_RATIO = 1.2
REFERENCE = "vllm"
# Service log events → (field, hop name): durations the stack's services log per request.
LOGGED_HOPS = {
    "prefilled": (("prefill_ms", "prefill"),),
    "wan_pushed": (("queue_ms", "push_queued"), ("elapsed_ms", "push")),
    "md_kv_imported": (("import_ms", "import"),),
}


def request_hops(rec: RequestResult) -> tuple[float | None, float | None]:
    """(handoff ms, decode ms per token) of one request: first → second token, and the mean
    interval from the second token to the last; None where it has too few tokens."""
    times = rec.token_times_ms
    handoff = times[1] - times[0] if len(times) >= 2 else None
    decode = (times[-1] - times[1]) / (len(times) - 2) if len(times) >= 3 else None
    return handoff, decode


def logged_hops(log_dir: Path, request_ids: Sequence[str]) -> dict[str, float | None]:
    """Hop name → P50 over ``request_ids`` of what the services logged (``LOGGED_HOPS``);
    lines that are not JSON, or of other requests, are skipped."""
    wanted = set(request_ids)
    values: dict[str, list[float]] = {hop: [] for fs in LOGGED_HOPS.values() for _, hop in fs}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"request_id"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("request_id") not in wanted:
                continue
            for field, hop in LOGGED_HOPS.get(event.get("event"), ()):
                if isinstance(event.get(field), (int, float)):
                    values[hop].append(float(event[field]))
    return {hop: percentile(v, 50) for hop, v in values.items()}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def budget_table(
    results: Mapping[int, Mapping[str, Mapping[str, Any]]],
    output_len: int,
    target_ratio: float = TARGET_RATIO,
) -> list[str]:
    """The printed lines; none when the run has no vLLM server to set the target."""
    rows: list[str] = []
    for n, by_name in results.items():
        ref = by_name.get(REFERENCE, {}).get("median_tok_s")
        if not ref or output_len < 3:
            continue
        target_round = 1000.0 * n * output_len / (target_ratio * ref)  # ms
        rows.append(f"{n:>4} target: a round of {target_round:.0f} ms ({target_ratio}x vLLM)")
        for name, s in by_name.items():
            parts = [s.get(k) for k in ("ttft_p50_ms", "handoff_p50_ms", "tail_p50_ms")]
            left = None
            if all(p is not None for p in parts):
                left = (target_round - sum(parts)) / (output_len - 2)
            hops = " ".join(
                f"{hop}={_ms(v)}"
                for hop, v in (s.get("logged_hops") or {}).items()
                if v is not None
            )
            round_ms = 1000.0 * n * output_len / s["median_tok_s"]
            rows.append(
                f"{'':>4} {name:<16}{round_ms:>9.0f}{_ms(parts[0]):>9}{_ms(parts[1]):>9}"
                f"{_ms(s.get('decode_p50_ms')):>9}{_ms(parts[2]):>7}{_ms(left):>10}  {hops}"
            )
    if not rows:
        return []
    head = (
        f"{'conc':>4} {'contender':<16}{'round':>9}{'TTFT':>9}{'handoff':>9}{'decode':>9}"
        f"{'tail':>7}{'budget':>10}  hops inside (stack, ms P50)"
    )
    return [
        "where a round goes (ms; P50 over requests; decode and budget per token: the interval "
        "the target leaves each decode token)",
        head,
        *rows,
    ]
