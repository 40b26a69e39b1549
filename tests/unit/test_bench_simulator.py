"""The discrete-event simulator: the link model's arithmetic, then the report's directions."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from pdd.bench.economics import cost_per_hour, economics
from pdd.bench.sim_command import main
from pdd.bench.sim_link import EventLoop, SimLink
from pdd.bench.simulator import MODES, SimConfig, _Run, simulate, workload

GB = 1e9


def run_link(transfers, **kw):
    """transfers: (submit_time, bytes, urgent); returns {index: (queue_s, flight_s, done_at)}."""
    loop = EventLoop()
    link = SimLink(loop, bytes_per_s=GB, **kw)
    done = {}
    for i, (t, n, urgent) in enumerate(transfers):
        loop.at(
            t,
            lambda i=i, n=n, u=urgent: link.submit(
                n, lambda q, f, i=i: done.__setitem__(i, (q, f, loop.now)), urgent=u
            ),
        )
    loop.run()
    return done, link


def test_link_shares_bandwidth_equally():
    done, _ = run_link([(0.0, 1 * GB, True), (0.0, 2 * GB, True)], streams=2)
    assert done[0] == pytest.approx((0.0, 2.0, 2.0))  # both at 0.5 GB/s until the first ends
    assert done[1] == pytest.approx((0.0, 3.0, 3.0))  # then the second alone at 1 GB/s


def test_link_pool_queues_beyond_its_streams():
    done, link = run_link([(0.0, 1 * GB, True), (0.5, 1 * GB, True)], streams=1)
    assert done[1] == pytest.approx((0.5, 1.0, 2.0))
    assert link.saturated_s == pytest.approx(2.0)


def test_link_per_stream_cap():
    done, _ = run_link(
        [(0.0, 1 * GB, True)], streams=4, stream_cap_bps=4 * GB
    )  # 0.5 GB/s per stream
    assert done[0] == pytest.approx((0.0, 2.0, 2.0))


def test_priority_and_reserved_streams():
    # Two background transfers hold the only non-reserved stream in turn; the urgent one skips the queue.
    transfers = [(0.0, 1 * GB, False), (0.0, 1 * GB, False), (0.1, 0.1 * GB, True)]
    done, _ = run_link(transfers, streams=2, priority=True, reserved=1)
    assert done[0][2] == pytest.approx(1.1)  # shared with the urgent one for 0.2 s
    assert done[2] == pytest.approx((0.0, 0.2, 0.3))
    assert done[1][0] == pytest.approx(1.1)  # waited for the non-reserved stream
    done, _ = run_link(transfers, streams=2)  # no priority: plain FIFO into a free stream
    assert done[1][0] == 0.0 and done[2][0] > 0.5


@pytest.fixture(scope="module")
def runs():
    out = {}
    for dist in ("skewed", "uniform"):
        cfg = SimConfig(dist=dist, requests=6000, seed=1)
        out.update({(dist, m): simulate(cfg, m) for m in MODES})
    return out


def test_uniform_hits_transfer_slower_at_the_median_and_saturate_the_pool(runs):
    skew, uni = runs["skewed", "cdc-pd"], runs["uniform", "cdc-pd"]
    assert uni["kv_transfer_ms"]["p50"] > 2 * skew["kv_transfer_ms"]["p50"]
    assert uni["pool_saturated"] > 0.2 and uni["kv_queue_ms"]["mean"] > 100


def test_skewed_hits_have_the_long_tail(runs):
    skew, uni = runs["skewed", "cdc-pd"], runs["uniform", "cdc-pd"]
    assert skew["kv_transfer_ms"]["p99"] > 2 * uni["kv_transfer_ms"]["p99"]
    assert skew["kv_transfer_ms"]["p99"] > 5000


def test_pdd_cuts_cdc_pd_tail_ttft_with_a_small_relay_share(runs):
    pdd, cdc = runs["skewed", "pdd"], runs["skewed", "cdc-pd"]
    assert pdd["ttft_s"]["p90"] < 0.6 * cdc["ttft_s"]["p90"]
    assert pdd["ttft_s"]["p99"] < cdc["ttft_s"]["p99"]
    assert 0.0 < pdd["rld_token_share"] < 0.10
    assert pdd["pipelines"]["p-rld-md"] == pytest.approx(0.25 * 6000, rel=0.1)  # the low-hit tail
    assert cdc["rld_token_share"] == 0.0 and cdc["pipelines"]["p-rld-md"] == 0
    assert pdd["handoff_gap_ms"]["p50"] is not None


def test_same_seed_same_numbers():
    cfg = SimConfig(requests=800, seed=5)
    assert simulate(cfg, "pdd") == simulate(cfg, "pdd")
    assert simulate(cfg, "pdd") != simulate(SimConfig(requests=800, seed=6), "pdd")


def run_requests(cfg, mode="pdd"):
    """(summary, requests): the requests carry each one's pipeline, miss and TTFT."""
    reqs = workload(cfg)
    return _Run(cfg, mode).run(reqs), reqs


def miss(r):
    return r.tokens * (1 - r.hit)


def test_local_prefill_off_is_the_design_router():
    cfg = SimConfig(requests=800, seed=5)
    off = simulate(cfg, "pdd")
    assert off == simulate(replace(cfg, local_prefill_tokens=0), "pdd")
    assert off["pipelines"] == {"md": 0, "p-md": 575, "p-rld-md": 225}
    # Recorded before pipeline MD existed: the off switch leaves the random draws and events alone.
    assert [off["ttft_s"][q] for q in ("p50", "p90", "p99")] == pytest.approx(
        [0.6505493218668645, 1.930283096686333, 2.588797837700116], rel=1e-12
    )
    assert off["rld_token_share"] == pytest.approx(0.05583448971868298, rel=1e-12)
    # Only PDD's router has pipeline MD.
    cdc = SimConfig(requests=800, seed=5, local_prefill_tokens=4096)
    assert simulate(cdc, "cdc-pd") == simulate(cfg, "cdc-pd")


def test_local_prefill_takes_short_misses_off_prefill_and_the_wan():
    # 16 MainDecode instances: enough prefill capacity for the skewed high-hit 75% (see the next test).
    base = SimConfig(requests=3000, seed=1, md_instances=16)
    off = simulate(base, "pdd")
    on, reqs = run_requests(replace(base, local_prefill_tokens=4096))
    md = [r for r in reqs if r.pipeline == "md"]
    assert (
        on["pipelines"]["md"] == len(md) > 0.7 * len(reqs)
    )  # every high-hit request, and a few others
    assert all(miss(r) <= 4096 for r in md) and all(
        miss(r) > 4096 for r in reqs if r.pipeline != "md"
    )
    assert all(r.transfer == 0 and r.queue == 0 and r.rld_tokens == 0 for r in md)
    assert on["wan_transfers"] == len(reqs) - len(md) < off["wan_transfers"] == len(reqs)
    assert on["wan_gb"] < off["wan_gb"]
    # KV percentiles cover the requests that sent KV only (MD's zeros would pull the median to 0).
    sent = [r.transfer * 1000 for r in reqs if r.pipeline != "md"]
    assert on["kv_transfer_ms"]["p50"] == pytest.approx(float(np.percentile(sent, 50)))
    assert on["kv_transfer_ms"]["p50"] > 0
    assert (
        on["ttft_s"]["p90"] <= off["ttft_s"]["p90"] and on["ttft_s"]["p50"] < off["ttft_s"]["p50"]
    )


def test_local_prefill_beyond_maindecode_capacity_costs_ttft():
    # The default 8 MainDecode instances cannot prefill 75% of RPS 80 (~9.8 instance-seconds a second).
    base = SimConfig(requests=3000, seed=1)
    off, on = simulate(base, "pdd"), simulate(replace(base, local_prefill_tokens=4096), "pdd")
    assert on["ttft_s"]["p90"] > 2 * off["ttft_s"]["p90"]
    assert on["md_prefill_wait_ms"]["p90"] > 1000


def test_maindecode_prefill_queues_and_costs_its_ttft():
    cfg = SimConfig(requests=2000, seed=1, rps=160, local_prefill_tokens=1024)
    ttft = {}
    for n in (8, 1):
        _, reqs = run_requests(replace(cfg, md_instances=n))
        md = [r for r in reqs if r.pipeline == "md"]
        for r in md:  # to MainDecode and back, its queue, its prefill, one step
            assert r.ttft == pytest.approx(
                2 * 0.020 + r.prefill_wait + 0.050 + miss(r) / 14_580 + 0.030
            )
        ttft[n] = np.mean([r.ttft for r in md])
    assert ttft[8] < 0.3 and ttft[1] > 10 * ttft[8]


def test_economics_searches_goodput_and_prices():
    cfg = SimConfig(requests=1500, rps=80)
    e = economics(cfg, steps=5)
    assert set(e["goodput_rps"]) == set(MODES) and all(g > 0 for g in e["goodput_rps"].values())
    assert (
        e["cost_per_hour"]["pdd"]
        == cost_per_hour(cfg, "pdd")
        == 40 + 0.5 * (8 + 4) + 40 * 20 * 0.002
    )
    per = {m: e["goodput_rps"][m] / e["cost_per_hour"][m] for m in MODES}
    assert e["benefit_cost_ratio"]["vs_cdc-pd"] == pytest.approx(per["pdd"] / per["cdc-pd"] - 1)


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "sim",
                "--dist",
                "uniform",
                "--requests",
                "500",
                "--modes",
                "cdc-pd,pdd",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "cdc-pd   uniform" in capsys.readouterr().out
    assert [r["mode"] for r in json.loads(out.read_text())["runs"]] == ["cdc-pd", "pdd"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("dist", "zipf"),
        ("rps", 0.0),
        ("pool_streams", 0),
        ("urgent_streams", 4),
        ("hit_threshold", 1.5),
        ("output_scale", 0.5),
        ("local_prefill_tokens", -1),
        ("md_prefill_tokens_per_s", 0.0),
    ],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})


def test_local_prefill_needs_maindecode():
    with pytest.raises(ValueError, match="md_instances"):
        SimConfig(local_prefill_tokens=256, md_instances=0)
    assert (
        SimConfig(md_instances=0).local_prefill_tokens == 0
    )  # off: MainDecode's count is only its cost
