"""``pdd bench link`` end to end on a small, fast configuration: the JSON it promises."""

from __future__ import annotations

import json

import pytest
import structlog

from pdd.testbed.link_bench import main


@pytest.fixture
def restore_logging():
    # main() configures logging (to this test's captured stderr) when nothing else has; an
    # earlier test in the same process may have configured structlog (to stdout) already.
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_bench_writes_configured_and_achieved_figures(tmp_path, capsys, restore_logging):
    out = tmp_path / "link.json"
    assert (
        main(
            [
                "--mbps",
                "400",
                "--delay-ms",
                "2",
                "--sizes-mb",
                "1,2",
                "--fast-link-mb",
                "8",
                "--probe-s",
                "0.1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["configured_mbps"] == 400 and result["configured_rtt_ms"] == 4
    assert [r["size_mb"] for r in result["wan"]] == [1, 2]
    # Loose sanity bounds (two busy cores); the benchmark itself reports the tight targets.
    assert 200 <= result["achieved_mbps"] <= 520
    assert 300 <= result["emulator_mbps"] <= 500 and result["emulator_rtt_ms"] >= 4
    assert all(
        r["attempts"] == 1 and 0 < r["per_chunk_overhead_bytes"] < 4096 for r in result["wan"]
    )
    assert result["fast_link_gbps"] > 0 and result["memcpy_gbps"] > 0
    # The push's CPU at each end: a P-MD burst of 16 prompts of 128 tokens, the receiver apart.
    cpu = result["wan_push_cpu"]
    assert (cpu["pushes"], cpu["push_bytes"], cpu["streams"]) == (16, 128 * 10 * 2 * 4 * 64 * 4, 4)
    assert cpu["mib_per_s"] > 0 and cpu["burst_ms"] > 0
    assert cpu["sender_cpu_ms_per_mib"] > 0 and cpu["receiver_cpu_ms_per_mib"] > 0
    assert set(result["targets"]) == {
        "wan_ge_90pct_from_4mb",
        "emulator_bandwidth_within_5pct",
        "emulator_rtt_within_5pct",
        "fast_link_ge_50pct_memcpy",
    }


async def test_a_fast_links_probe_is_capped_and_streamed(monkeypatch):
    """100 Gbit/s × 1 s of probe was 12.5 GB allocated at once (the bench was killed for memory):
    the probe is capped, and written a MiB at a time."""
    from pdd.testbed import link_bench
    from pdd.testbed.link_emulator import LinkConfig

    monkeypatch.setattr(link_bench, "_PROBE_MAX_BYTES", 8 * link_bench._MIB)
    written = []
    real_bytes = bytes

    def spy_bytes(n=0):
        if isinstance(n, int):
            written.append(n)
        return real_bytes(n)

    monkeypatch.setattr(link_bench, "bytes", spy_bytes, raising=False)
    raw = await link_bench._raw_link(LinkConfig(mbps=100_000, delay_ms=0), probe_s=1.0)
    assert raw["emulator_bytes"] == 8 * link_bench._MIB
    assert max(written) <= link_bench._MIB  # never the whole probe in one buffer


def test_the_push_cpu_measure_needs_two_bursts_and_something_to_push():
    from pdd.testbed.push_cpu import PushCpuConfig

    for bad in ({"bursts": 1}, {"pushes": 0}, {"streams": 0}):
        with pytest.raises(ValueError, match="pushes"):
            PushCpuConfig(**bad)
