"""``pdd bench clusters``: two remote clusters (a fast link and a slow one), router against router.

    pdd bench clusters [--out DIR] [--dists skewed,uniform] [--contenders cdc-pd,hit-only,link-aware]
        [--sessions N] [--cluster NAME:MBPS:DELAY_MS:N ...] [--gateway-flag=--ttft-budget-s=0.4 ...]
        [testbed flags]

The preset (``PRESETS["two-cluster"]``): one MainDecode behind a fast link (``fast``) and one
behind a slow one (``slow``), each its own emulated WAN (``pdd.testbed.stack``'s clusters), the
main cluster's prefill and relay in front. Per hit distribution (``pdd.bench.trace``: skewed,
uniform) one trace (the ``pdd demo`` quick preset's shape, that distribution), and per contender
one fresh stack and one run of it (``runner.run_mode``, so warm-up, pinning and records as
``pdd bench run``):

  cdc-pd      no relay: every request P-MD, its user waiting for the delta on whichever link
              (the baseline of the issue's "P90 TTFDT ≤ 0.55 × CDC-PD");
  hit-only    the relay and the report's router: ``--pipeline-policy threshold`` (θ on the
              predicted hit alone; MainDecode by hit and load, blind to the links);
  link-aware  the relay and ``--pipeline-policy link_aware``: MainDecode by hit, load and its
              link's estimated transfer time; the relay only when that time exceeds the budget.

The table has a row per (distribution, contender): P90/P99 TTFDT, its P90 as a ratio of
cdc-pd's on the same trace, the RLD token share, the WAN queue time (a KV push's wait for a slot
of prefill's stream pool, mean and P90 from prefill's ``pdd_wan_kv_queue_seconds``; the P90 is
the upper bound of its histogram bucket, warm-up included), the share of WAN bytes that went to
the cluster behind the slowest link (each link's ``pdd_wan_link_bytes_total``) and errors. ``DIR`` gets every run's
RESULT json, records and logs, and ``clusters.md`` with the table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdd.bench import modes
from pdd.bench.runner import DEFAULT_SLO, add_testbed_flags, run_mode, testbed_from
from pdd.bench.trace import DISTS, TraceConfig, describe, generate, write_trace
from pdd.testbed.stack import ClusterSpec, LinkSettings, Stack, StackConfig

# The testbed's WAN is 80 Mbit/s, 1 ms (``modes.Testbed``): the fast cluster has 2.5 × that, the
# slow one a quarter, with a regional link's delay — a low-hit delta (1-4 MB) takes 0.4-1.6 s on
# it, against tens of ms on the fast link.
PRESETS: dict[str, tuple[ClusterSpec, ...]] = {
    "two-cluster": (
        ClusterSpec("fast", LinkSettings(200.0, 1.0, 0.5), 1),
        ClusterSpec("slow", LinkSettings(20.0, 10.0, 0.5), 1),
    ),
}
# Contender → (the serving mode it runs as, its gateway's --pipeline-policy).
CONTENDERS: dict[str, tuple[str, str]] = {
    "cdc-pd": ("cdc-pd", "threshold"),
    "hit-only": ("pdd", "threshold"),
    "link-aware": ("pdd", "link_aware"),
}
BASELINE = "cdc-pd"
START_TIMEOUT_S = 360.0
# The `pdd demo` quick preset's shape (40 requests of 10 sessions); its dist is set per run.
TRACE = TraceConfig(
    sessions=10,
    turns=4,
    rps=2.0,
    seed=0,
    prompt_tokens=1024,
    max_context_tokens=4096,
    output_scale=2.0,
    vocab_high=4096,
    concurrent_sessions=2,
)


@dataclass(frozen=True)
class ClustersBenchConfig:
    out: Path = Path("pdd-report-clusters")
    preset: str = "two-cluster"
    dists: tuple[str, ...] = DISTS
    contenders: tuple[str, ...] = tuple(CONTENDERS)
    trace: TraceConfig = TRACE
    testbed: modes.Testbed = field(default_factory=modes.Testbed)
    # More gateway flags for every contender (e.g. --ttft-budget-s=0.4, --relay-max-requests=8).
    gateway_flags: tuple[str, ...] = ()
    # Instead of the preset's clusters (``pdd up --cluster``'s form); () = the preset's.
    clusters: tuple[ClusterSpec, ...] = ()
    slo: str = DEFAULT_SLO
    redis_url: str = ""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if not self.dists or any(d not in DISTS for d in self.dists):
            raise ValueError(f"dists: each one of {', '.join(DISTS)}, got {self.dists!r}")
        if not self.contenders or any(c not in CONTENDERS for c in self.contenders):
            raise ValueError(
                f"contenders: each one of {', '.join(CONTENDERS)}, got {self.contenders!r}"
            )
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise ValueError(f"clusters: names must be unique, got {names}")
        for name in ("dists", "contenders"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name}: repeated, got {getattr(self, name)!r}")


def stack_config(
    contender: str,
    testbed: modes.Testbed,
    clusters: Sequence[ClusterSpec],
    *,
    log_dir: Path,
    redis_url: str = "",
    key_prefix: str = "pdd",
    gateway_flags: Sequence[str] = (),
) -> StackConfig:
    """The mode's stack (``modes.stack_config``) with ``clusters`` for its one remote cluster."""
    mode, policy = CONTENDERS[contender]
    base = modes.stack_config(
        mode, testbed, log_dir=log_dir, redis_url=redis_url, key_prefix=key_prefix
    )
    return replace(
        base,
        main_decode=1,
        wan=LinkSettings(),
        clusters=tuple(clusters),
        # NOTE: two MainDecodes more than a mode's stack load their models at once.
        start_timeout_s=START_TIMEOUT_S,
        gateway_flags=(*base.gateway_flags, "--pipeline-policy", policy, *gateway_flags),
    )


def scrape(address: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics endpoint: (name, labels, value)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def queue_ms(samples: Sequence[tuple[str, Mapping[str, str], float]]) -> dict[str, float | None]:
    """Mean and P90 (its bucket's upper bound) of ``pdd_wan_kv_queue_seconds``, in ms."""
    name = "pdd_wan_kv_queue_seconds"
    count = sum(v for n, _, v in samples if n == f"{name}_count")
    total = sum(v for n, _, v in samples if n == f"{name}_sum")
    if not count:
        return {"mean": None, "p90": None, "pushes": 0}
    buckets = sorted((float(labels["le"]), v) for n, labels, v in samples if n == f"{name}_bucket")
    p90 = next((le for le, cum in buckets if cum >= 0.9 * count), math.inf)
    return {"mean": 1000 * total / count, "p90": 1000 * p90, "pushes": int(count)}


def slowest(clusters: Sequence[ClusterSpec]) -> str:
    """The cluster behind the slowest link (0 Mbit/s is unlimited: the fastest)."""
    return min(clusters, key=lambda c: (c.link.mbps or math.inf, -c.link.delay_ms)).name


def link_bytes(samples: Sequence[tuple[str, Mapping[str, str], float]]) -> float:
    """Bytes a link delivered towards its cluster (``pdd_wan_link_bytes_total``, direction up)."""
    return sum(
        v
        for n, labels, v in samples
        if n == "pdd_wan_link_bytes_total" and labels.get("direction") == "up"
    )


def measure(stack: Stack) -> dict:
    """What RESULT does not hold: prefill's WAN queue time and each cluster link's bytes."""
    queue = queue_ms(scrape(stack.metrics["prefill-0"]))
    links = {
        c.name: link_bytes(scrape(stack.metrics[f"wan-{c.name}"]))
        for c in stack.config.remote_clusters
    }
    return {"wan_queue_ms": queue, "link_bytes": links, "slowest": slowest(stack.config.clusters)}


@dataclass(frozen=True)
class Row:
    dist: str
    contender: str
    ttfdt_p90_ms: float | None
    ttfdt_p99_ms: float | None
    rld_share: float | None
    queue_mean_ms: float | None
    queue_p90_ms: float | None
    slow_bytes_share: float | None
    pipelines: Mapping[str, int]
    errors: int


def row_of(dist: str, contender: str, result: Mapping, measured: Mapping) -> Row:
    links = measured.get("link_bytes") or {}
    total = sum(links.values())
    queue = measured.get("wan_queue_ms") or {}
    return Row(
        dist=dist,
        contender=contender,
        ttfdt_p90_ms=result["ttfdt_ms"]["p90"],
        ttfdt_p99_ms=result["ttfdt_ms"]["p99"],
        rld_share=result["rld_token_share"],
        queue_mean_ms=queue.get("mean"),
        queue_p90_ms=queue.get("p90"),
        slow_bytes_share=links.get(measured.get("slowest", ""), 0.0) / total if total else None,
        pipelines=dict(result["pipelines"]),
        errors=int(result["errors"]),
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else ("≥inf" if math.isinf(v) else f"{v:.0f}")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


HEADER = (
    "dist",
    "router",
    "TTFDT P90 ms",
    "TTFDT P99 ms",
    "P90 ÷ cdc-pd",
    "RLD share",
    "WAN queue mean ms",
    "WAN queue P90 ms",
    "slow-link bytes",
    "pipelines",
    "errors",
)


def table_cells(rows: Sequence[Row]) -> list[list[str]]:
    """The table's cells, a header row first; the ratio is to cdc-pd's P90 on the same dist."""
    base = {r.dist: r.ttfdt_p90_ms for r in rows if r.contender == BASELINE}
    out = [list(HEADER)]
    for r in rows:
        b = base.get(r.dist)
        ratio = "-" if not b or r.ttfdt_p90_ms is None else f"{r.ttfdt_p90_ms / b:.2f}"
        pipes = " ".join(f"{k}:{v}" for k, v in sorted(r.pipelines.items()))
        out.append(
            [
                r.dist,
                r.contender,
                _ms(r.ttfdt_p90_ms),
                _ms(r.ttfdt_p99_ms),
                ratio,
                _pct(r.rld_share),
                _ms(r.queue_mean_ms),
                _ms(r.queue_p90_ms),
                _pct(r.slow_bytes_share),
                pipes or "-",
                str(r.errors),
            ]
        )
    return out


def text_table(rows: Sequence[Row]) -> str:
    cells = table_cells(rows)
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row]) -> str:
    cells = table_cells(rows)
    head, body = cells[0], cells[1:]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def run(cfg: ClustersBenchConfig) -> list[Row]:
    t0 = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    clusters = cfg.clusters or PRESETS[cfg.preset]
    print(
        "[pdd bench clusters] "
        + "; ".join(f"{c.name}: {c.main_decodes} MainDecode, {c.describe()}" for c in clusters),
        flush=True,
    )
    rows: list[Row] = []
    for dist in cfg.dists:
        trace = generate(replace(cfg.trace, dist=dist))
        write_trace(trace, cfg.out / f"trace-{dist}.jsonl")
        print(f"[pdd bench clusters] {dist}: {describe(trace)}", flush=True)
        for contender in cfg.contenders:
            name = f"{dist}-{contender}"
            measured: dict = {}
            config = stack_config(
                contender,
                cfg.testbed,
                clusters,
                log_dir=cfg.out / "logs" / name,
                redis_url=cfg.redis_url,
                key_prefix=f"bench-{name}-{time.time_ns():x}",
                gateway_flags=cfg.gateway_flags,
            )
            print(f"[pdd bench clusters] {name}: starting its stack", flush=True)
            outcome = run_mode(
                trace,
                CONTENDERS[contender][0],
                cfg.out / f"{name}.json",
                testbed=cfg.testbed,
                log_dir=config.log_dir,
                redis_url=cfg.redis_url,
                slo=cfg.slo,
                load={"progress": False},
                config=config,
                before_stop=lambda stack, m=measured: m.update(measure(stack)),
            )
            rows.append(row_of(dist, contender, outcome.result, measured))
            print(text_table(rows[-1:]).splitlines()[-1], flush=True)
    (cfg.out / "clusters.md").write_text(
        f"# pdd bench clusters ({cfg.preset})\n\n"
        + "".join(f"- {c.name}: {c.main_decodes} MainDecode, {c.describe()}\n" for c in clusters)
        + "\n"
        + markdown_table(rows)
        + "\n"
    )
    print()
    print(text_table(rows))
    print(f"\n{cfg.out}/clusters.md, {time.monotonic() - t0:.0f} s")
    return rows


def _cluster(text: str) -> ClusterSpec:
    try:
        return ClusterSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdd bench clusters",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = ClustersBenchConfig()
    p.add_argument("--out", type=Path, default=d.out, help="results, logs and clusters.md")
    p.add_argument("--preset", choices=tuple(PRESETS), default=d.preset)
    p.add_argument(
        "--cluster",
        dest="clusters",
        action="append",
        type=_cluster,
        default=[],
        metavar="NAME:MBPS:DELAY-MS:MAIN-DECODES",
        help="a remote cluster instead of the preset's (repeatable; --wan-* do not apply)",
    )
    p.add_argument("--dists", default=",".join(d.dists), help="hit distributions, in order")
    p.add_argument("--contenders", default=",".join(d.contenders), help="routers, in order")
    p.add_argument("--sessions", type=int, default=None, help="trace sessions (default 10)")
    p.add_argument("--seed", type=int, default=None, help="trace seed (default 0)")
    p.add_argument(
        "--gateway-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra gateway flag for every contender, e.g. --gateway-flag=--ttft-budget-s=0.4",
    )
    p.add_argument("--slo", default=DEFAULT_SLO)
    p.add_argument("--redis-url", default="")
    add_testbed_flags(p)
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        trace = TRACE
        if a.sessions is not None:
            trace = replace(trace, sessions=a.sessions)
        if a.seed is not None:
            trace = replace(trace, seed=a.seed)
        cfg = ClustersBenchConfig(
            out=a.out,
            preset=a.preset,
            dists=_names(a.dists),
            contenders=_names(a.contenders),
            trace=trace,
            testbed=testbed_from(a),
            gateway_flags=tuple(a.gateway_flag),
            clusters=tuple(a.clusters),
            slo=a.slo,
            redis_url=a.redis_url,
        )
    except ValueError as e:
        p.error(str(e))
    rows = run(cfg)
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
