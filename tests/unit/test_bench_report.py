"""The comparison table, the ratios, the Markdown report and its PNG plots."""

from __future__ import annotations

from pdd.bench.metrics import build_result, write_result
from pdd.bench.record import RequestResult, records_path, write_records
from pdd.bench.report import compare, main, pick_timeline, ttft_ratios, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def records(ttfts: list[float], outputs: list[list[int]], relay: bool) -> list[RequestResult]:
    out = []
    for i, (t, toks) in enumerate(zip(ttfts, outputs)):
        n = len(toks)
        times = [t + 20.0 * k + (100.0 if relay and k >= 2 else 0.0) for k in range(n)]
        stages = (["relay"] * 2 + ["main_decode"] * (n - 2)) if relay else ["main_decode"] * n
        out.append(
            RequestResult(
                request_id=f"r{i}",
                ttft_ms=t,
                e2el_ms=times[-1],
                tpot_ms=(times[-1] - t) / (n - 1),
                itl_ms=[b - a for a, b in zip(times, times[1:])],
                output_token_ids=toks,
                token_times_ms=times,
                token_stages=stages,
                pipeline="p-rld-md" if relay else "p-md",
                handoff_mode="one-shot" if relay else "",
                handoff_at_token=2 if relay else 0,
                handoff_gap_ms=120.0 if relay else None,
                rld_tokens=2 if relay else 0,
                md_tokens=n - 2 if relay else n,
                wan_bytes=2_500_000,
            )
        )
    return out


OUTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
RECS = {
    "idc-pd": records([3900.0, 10400.0, 17200.0], OUTS, relay=False),
    "cdc-pd": records([5000.0, 18300.0, 29700.0], OUTS[:2] + [[9, 10, 11, 99]], relay=False),
    "pdd": records([4200.0, 9800.0, 14400.0], OUTS, relay=True),
}
RESULTS = [
    build_result(m, r, 10.0, slo="ttft_ms:10000", link={"mbps": 20000.0}) for m, r in RECS.items()
]


def test_compare_prints_the_numbers_and_ratios():
    text = compare(RESULTS)
    lines = text.splitlines()
    assert lines[0].split() == ["idc-pd", "cdc-pd", "pdd"]
    row = {line[:20].strip(): line[20:].split() for line in lines[2:] if line[:20].strip()}
    # P90 of three values is the linear interpolation between the 2nd and 3rd.
    assert row["TTFT P90 (ms)"] == [
        f"{10400 + 0.8 * 6800:.0f}",
        f"{18300 + 0.8 * 11400:.0f}",
        f"{9800 + 0.8 * 4600:.0f}",
    ]
    assert row["TTFT P50 (ms)"] == ["10400", "18300", "9800"]
    assert row["goodput (req/s)"] == ["0.100", "0.100", "0.200"]
    assert row["RLD token share"] == ["0.0%", "0.0%", "50.0%"]
    assert row["WAN bytes"] == ["7.5", "MB"] * 3
    assert row["handoff gap P99 (ms)"] == ["-", "-", "120"]
    assert row["errors"] == ["0", "0", "0"]
    ratios = dict(((a, b), r) for a, b, r in ttft_ratios(RESULTS))
    assert ratios[("pdd", "cdc-pd")] == (9800 + 0.8 * 4600) / (18300 + 0.8 * 11400)
    assert f"pdd P90 TTFT ÷ cdc-pd: {ratios[('pdd', 'cdc-pd')]:.2f}" in text
    assert f"pdd P90 TTFT ÷ idc-pd: {ratios[('pdd', 'idc-pd')]:.2f}" in text
    assert "identical outputs across modes: 2/3 requests" in text


def test_write_report_renders_markdown_and_pngs(tmp_path):
    path = write_report(RESULTS, tmp_path / "rep", records=RECS)
    md = path.read_text()
    assert "| TTFT P50 (ms) | 10400 | 18300 | 9800 |" in md
    assert "pdd P90 TTFT ÷ cdc-pd" in md and "![timeline](timeline.png)" in md
    for png in ("ttft_cdf.png", "timeline.png"):
        data = (tmp_path / "rep" / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    assert pick_timeline(RECS["pdd"]).handoff_gap_ms == 120.0
    assert pick_timeline(RECS["cdc-pd"]) is None


def test_report_without_records_plots_percentile_points(tmp_path):
    write_report(RESULTS[:2], tmp_path)
    assert (tmp_path / "ttft_cdf.png").read_bytes().startswith(PNG)
    assert not (tmp_path / "timeline.png").exists()


def test_cli_compares_files_and_finds_records(tmp_path, capsys):
    paths = []
    for result in RESULTS:
        p = tmp_path / f"{result['mode']}.json"
        write_result(result, p)
        write_records(RECS[result["mode"]], records_path(p))
        paths.append(str(p))
    assert main(["compare", *paths, "--report", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "TTFT P90 (ms)" in out and "identical outputs across modes: 2/3" in out
    assert (tmp_path / "out" / "timeline.png").exists() and (
        tmp_path / "out" / "report.md"
    ).exists()
