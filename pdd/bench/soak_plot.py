"""The soak's plot as a self-contained SVG: resident memory and KV use over time per service.

Two panels share the time axis: RSS (MiB) of every process, and KV blocks used of every engine
instance; a dashed line marks each restart. No plotting library: the README embeds the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

from pdd.bench.soak_samples import Sample

W, PANEL_H, PAD_L, PAD_R, PAD_T, GAP = 760, 220, 64, 170, 28, 46
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _series(samples: Sequence[Sample], value) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for s in sorted(samples, key=lambda s: s.t_s):
        v = value(s)
        if v is not None and s.t_s >= 0:
            out.setdefault(s.process, []).append((s.t_s, v))
    return out


def _panel(
    top: float,
    title: str,
    unit: str,
    series: Mapping[str, list[tuple[float, float]]],
    t_max: float,
    marks: Sequence[float],
) -> list[str]:
    inner_w, inner_h = W - PAD_L - PAD_R, PANEL_H
    y_max = max((v for pts in series.values() for _, v in pts), default=1.0) * 1.08 or 1.0

    def x(t: float) -> float:
        return PAD_L + inner_w * (t / t_max if t_max else 0.0)

    def y(v: float) -> float:
        return top + inner_h * (1 - v / y_max)

    out = [
        f'<text x="{PAD_L}" y="{top - 8}" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{PAD_L}" y="{top}" width="{inner_w}" height="{inner_h}" fill="none" '
        'stroke="#999"/>',
    ]
    for k in range(5):
        v = y_max * k / 4
        out.append(
            f'<text x="{PAD_L - 6}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">'
            f"{v:.0f}</text>"
        )
        out.append(
            f'<line x1="{PAD_L}" y1="{y(v):.1f}" x2="{PAD_L + inner_w}" y2="{y(v):.1f}" '
            'stroke="#eee"/>'
        )
    out.append(
        f'<text x="14" y="{top + inner_h / 2:.0f}" font-size="11" '
        f'transform="rotate(-90 14 {top + inner_h / 2:.0f})" text-anchor="middle">{unit}</text>'
    )
    for t in marks:
        out.append(
            f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{top + inner_h}" '
            'stroke="#555" stroke-dasharray="4 3"/>'
        )
    for i, (name, pts) in enumerate(sorted(series.items())):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        ly = top + 12 + 15 * i
        out.append(
            f'<line x1="{W - PAD_R + 10}" y1="{ly - 4}" x2="{W - PAD_R + 26}" y2="{ly - 4}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{W - PAD_R + 30}" y="{ly}" font-size="11">{escape(name)}</text>')
    return out


def render(samples: Sequence[Sample], restarts: Sequence[float], title: str) -> str:
    """The SVG document."""
    t_max = max((s.t_s for s in samples), default=1.0) or 1.0
    rss = _series(samples, lambda s: s.rss_bytes / 2**20 if s.rss_bytes else None)
    kv = _series(samples, lambda s: s.gauges.get("pdd_kv_blocks_used"))
    top2 = PAD_T + PANEL_H + GAP
    h = top2 + PANEL_H + 40
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" '
        f'font-family="sans-serif" viewBox="0 0 {W} {h}">',
        f'<rect width="{W}" height="{h}" fill="white"/>',
        *_panel(PAD_T, f"{title}: resident memory per process", "MiB", rss, t_max, restarts),
        *_panel(top2, "KV blocks used per engine instance", "blocks", kv, t_max, restarts),
    ]
    for k in range(6):
        t = t_max * k / 5
        xx = PAD_L + (W - PAD_L - PAD_R) * k / 5
        body.append(
            f'<text x="{xx:.1f}" y="{top2 + PANEL_H + 16}" font-size="10" text-anchor="middle">'
            f"{t:.0f}</text>"
        )
    body.append(
        f'<text x="{PAD_L + (W - PAD_L - PAD_R) / 2:.0f}" y="{top2 + PANEL_H + 32}" '
        'font-size="11" text-anchor="middle">seconds (dashed: restart)</text>'
    )
    body.append("</svg>")
    return "\n".join(body) + "\n"
