"""Side-by-side comparison of benchmark RESULTs, as text, Markdown and plots.

``compare`` prints one column per mode (TTFT and TTFDT P50/P90/P99, TPOT and
ITL P50, goodput, RLD token share, WAN bytes, handoff gap and window, ITL P99, CPU, errors), then
the subject mode's (PDD's) P90 TTFT and TTFDT as ratios of every other mode's
(CDC-PD, IDC-PD), then how many requests produced identical output tokens in
every mode (greedy outputs must match across pipelines). ``write_report`` adds
``report.md`` and two PNGs (matplotlib, Agg): the TTFT and TTFDT CDFs per mode
(from per-request records when given, else the P50/P90/P99 points alone) and
the timeline of one P-RLD-MD request — its tokens over time coloured by stage,
with the handoff gap marked. TTFDT (first decode-stage token) is defined in
``metrics``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from pdd.bench.metrics import read_result
from pdd.bench.record import RequestResult, read_records, records_path

STAGE_COLORS = {"prefill": "tab:green", "relay": "tab:orange", "main_decode": "tab:blue"}
CDF_METRICS = (
    ("ttft_ms", "TTFT: first token (prefill's)"),
    ("ttfdt_ms", "TTFDT: first decode-stage token"),
)


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return (f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}") + unit


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def rows(results: Sequence[Mapping]) -> list[tuple[str, list[str]]]:
    """The table: (label, one cell per result)."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    def q(key: str, p: str) -> Callable[[Mapping], str]:
        return lambda r: _num((r.get(key) or {}).get(p))

    def cpu(r: Mapping) -> str:
        c = r.get("cpu") or {}
        return (
            "-"
            if c.get("machine_busy") is None
            else f"{100 * c['machine_busy']:.0f}% of {c['cores']}"
        )

    spec = [
        ("requests", lambda r: str(r["requests"])),
        ("TTFT P50 (ms)", q("ttft_ms", "p50")),
        ("TTFT P90 (ms)", q("ttft_ms", "p90")),
        ("TTFT P99 (ms)", q("ttft_ms", "p99")),
        ("TTFDT P50 (ms)", q("ttfdt_ms", "p50")),
        ("TTFDT P90 (ms)", q("ttfdt_ms", "p90")),
        ("TTFDT P99 (ms)", q("ttfdt_ms", "p99")),
        ("TPOT P50 (ms)", q("tpot_ms", "p50")),
        ("ITL P50 (ms)", q("itl_ms", "p50")),
        (
            "goodput (req/s)",
            lambda r: "-" if r["goodput_rps"] is None else f"{r['goodput_rps']:.3f}",
        ),
        ("RLD token share", lambda r: pct(r["rld_token_share"])),
        ("P-RLD-MD requests", lambda r: str(r["pipelines"].get("p-rld-md", 0))),
        ("MD-only requests (local prefill)", lambda r: str(r["pipelines"].get("md", 0))),
        ("WAN bytes", lambda r: _bytes(r["wan_bytes"])),
        ("handoff gap P50 (ms)", q("handoff_gap_ms", "p50")),
        ("handoff gap P99 (ms)", q("handoff_gap_ms", "p99")),
        (
            "handoff window P50 / P99 (ms)",
            lambda r: f"{q('handoff_window_ms', 'p50')(r)} / {q('handoff_window_ms', 'p99')(r)}"
            if (r.get("handoff_window_ms") or {}).get("p50") is not None
            else "-",
        ),
        ("ITL P99 (ms)", q("itl_ms", "p99")),
        ("CPU busy", cpu),
        ("errors", lambda r: str(r["errors"])),
    ]
    return [(label, [f(r) for r in results]) for label, f in spec]


def ttft_ratios(
    results: Sequence[Mapping], subject: str = "pdd", key: str = "ttft_ms"
) -> list[tuple[str, str, float | None]]:
    """(subject, other, subject's P90 of ``key`` ÷ other's) for every other mode."""
    subj = next((r for r in results if r["mode"].lower() == subject.lower()), None)
    if subj is None:
        return []
    out = []
    for r in results:
        if r is subj:
            continue
        a, b = (subj.get(key) or {}).get("p90"), (r.get(key) or {}).get("p90")
        out.append((subj["mode"], r["mode"], a / b if a is not None and b else None))
    return out


def output_agreement(results: Sequence[Mapping]) -> tuple[int, int]:
    """(requests with identical outputs in every result, requests present in every result)."""
    if len(results) < 2:
        return 0, 0
    common = set.intersection(*(set(r["outputs"]) for r in results))
    same = sum(all(r["outputs"][k] == results[0]["outputs"][k] for r in results) for k in common)
    return same, len(common)


def compare(results: Sequence[Mapping], subject: str = "pdd") -> str:
    table = [("", [r["mode"] for r in results])] + rows(results)
    w0 = max(len(label) for label, _ in table)
    widths = [max(len(cells[i]) for _, cells in table) for i in range(len(results))]
    lines = [
        "  ".join([label.ljust(w0)] + [c.rjust(w) for c, w in zip(cells, widths)])
        for label, cells in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    for key, name in (("ttft_ms", "TTFT"), ("ttfdt_ms", "TTFDT")):
        for a, b, ratio in ttft_ratios(results, subject, key):
            lines.append(f"{a} P90 {name} ÷ {b}: " + ("-" if ratio is None else f"{ratio:.2f}"))
    same, total = output_agreement(results)
    if total:
        lines.append(f"identical outputs across modes: {same}/{total} requests")
    return "\n".join(lines)


def _markdown_table(results: Sequence[Mapping]) -> str:
    head = "| metric | " + " | ".join(r["mode"] for r in results) + " |"
    sep = "|---|" + "---:|" * len(results)
    return "\n".join(
        [head, sep] + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows(results)]
    )


def pick_timeline(records: Sequence[RequestResult]) -> RequestResult | None:
    """The P-RLD-MD request with the median handoff gap (None if no request handed off)."""
    handed = sorted(
        (r for r in records if r.ok and r.handoff_gap_ms is not None),
        key=lambda r: r.handoff_gap_ms,
    )
    return handed[len(handed) // 2] if handed else None


def plot_ttft_cdf(
    results: Sequence[Mapping],
    path: Path,
    records: Mapping[str, Sequence[RequestResult]] | None = None,
) -> None:
    """Two panels: the TTFT CDF and the TTFDT CDF, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CDF_METRICS), figsize=(12, 4.5), sharey=True)
    for ax, (key, title) in zip(axes, CDF_METRICS):
        for r in results:
            recs = (records or {}).get(r["mode"])
            values = np.sort(
                [v for v in (getattr(x, key) for x in recs or () if x.ok) if v is not None]
            )
            if len(values):
                frac = np.arange(0, len(values) + 1) / len(values)
                ax.step(np.r_[values[0], values], frac, where="post", label=r["mode"])
                continue
            summary = r.get(key) or {}
            pts = [
                (summary[k], p)
                for k, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
                if summary.get(k) is not None
            ]
            if pts:
                ax.plot(*zip(*pts), "o--", label=f"{r['mode']} (P50/P90/P99 only)")
        ax.set_xlabel("ms since the request was sent")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_ylabel("fraction of requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(rec: RequestResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    times, stages = np.asarray(rec.token_times_ms), np.asarray(rec.token_stages)
    for stage in dict.fromkeys(rec.token_stages):
        idx = np.flatnonzero(stages == stage)
        ax.scatter(
            times[idx],
            idx,
            s=10,
            color=STAGE_COLORS.get(stage, "tab:gray"),
            label=f"{stage} tokens",
        )
    if rec.handoff_gap_ms is not None:
        first_md = rec.token_stages.index("main_decode")
        t1 = rec.token_times_ms[first_md]
        ax.axvspan(
            t1 - rec.handoff_gap_ms,
            t1,
            color="tab:red",
            alpha=0.15,
            label=f"handoff gap {rec.handoff_gap_ms:.0f} ms (at token {rec.handoff_at_token})",
        )
    if rec.ttft_ms is not None:
        ax.axvline(rec.ttft_ms, color="k", lw=0.8, ls=":", label=f"TTFT {rec.ttft_ms:.0f} ms")
    ax.set_xlabel("time since request sent (ms)")
    ax.set_ylabel("output token index")
    ax.set_title(f"{rec.request_id}: {rec.pipeline or '?'} {rec.handoff_mode}".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    results: Sequence[Mapping],
    folder: str | Path,
    timeline: RequestResult | None = None,
    records: Mapping[str, Sequence[RequestResult]] | None = None,
    subject: str = "pdd",
    sections: Sequence[str] = (),
) -> Path:
    """``report.md`` + ``ttft_cdf.png`` (+ ``timeline.png`` for a request that handed off); returns report.md.

    ``records`` maps a mode to its per-request records (for the real CDF); without
    ``timeline`` one is picked from the subject mode's records. ``sections`` are
    Markdown blocks put after the table (the demo's targets, scale, CPU).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plot_ttft_cdf(results, folder / "ttft_cdf.png", records)
    if timeline is None and records:
        subj = next((m for m in records if m.lower() == subject.lower()), None)
        timeline = pick_timeline(records[subj]) if subj else None
    lines = ["# PDD benchmark report", "", _markdown_table(results), ""]
    for key, name in (("ttft_ms", "TTFT"), ("ttfdt_ms", "TTFDT")):
        for a, b, ratio in ttft_ratios(results, subject, key):
            lines.append(
                f"- {a} P90 {name} ÷ {b}: " + ("-" if ratio is None else f"**{ratio:.2f}**")
            )
    same, total = output_agreement(results)
    if total:
        lines.append(f"- identical outputs across modes: {same}/{total} requests")
    for r in results:
        slo = ", ".join(f"{k} ≤ {v:g}" for k, v in r["slo"].items()) or "none"
        link = ", ".join(f"{k}={v}" for k, v in r["link"].items()) or "not recorded"
        lines.append(
            f"- {r['mode']}: {r['duration_s']:.1f} s, SLO {slo}; link {link}; pipelines {r['pipelines']}"
        )
    for block in sections:
        lines += ["", block.rstrip()]
    lines += ["", "## TTFT and TTFDT CDF", "", "![TTFT CDF](ttft_cdf.png)", ""]
    if timeline is not None:
        plot_timeline(timeline, folder / "timeline.png")
        lines += ["## One P-RLD-MD request", "", "![timeline](timeline.png)", ""]
    (folder / "report.md").write_text("\n".join(lines))
    return folder / "report.md"


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench compare RESULT.json... [--report DIR] [--subject pdd]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="pdd bench compare", description="Compare benchmark RESULT files."
    )
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument(
        "--report", type=Path, default=None, help="also write report.md + plots into this folder"
    )
    p.add_argument(
        "--subject", default="pdd", help="the mode whose P90 TTFT is divided by the others'"
    )
    a = p.parse_args(argv)
    try:
        results = [read_result(path) for path in a.results]
    except (OSError, ValueError) as e:
        p.error(str(e))
    print(compare(results, a.subject))
    if a.report is not None:
        recs = {
            r["mode"]: read_records(records_path(path))
            for r, path in zip(results, a.results)
            if records_path(path).exists()
        }
        print(f"wrote {write_report(results, a.report, records=recs, subject=a.subject)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
