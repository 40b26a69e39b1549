"""The discrete-event simulator: the link model's arithmetic, then the batched model's behaviour."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from pdd.bench.economics import Prices, cost_per_hour
from pdd.bench.sim_command import main
from pdd.bench.sim_link import EventLoop, SimLink
from pdd.bench.sim_profile import load_profile
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


# A small deployment at the report's scale (64K contexts): 2 minutes of traffic, seconds to run.
SMALL = SimConfig(duration_s=120, warmup_s=20, rps=4, live_sessions=64, seed=1)


@pytest.fixture(scope="module")
def runs():
    return {m: simulate(SMALL, m) for m in MODES}


def test_every_request_is_served_and_the_modes_share_the_workload(runs):
    n = {r["requests"] for r in runs.values()}
    assert len(n) == 1 and n.pop() > 300
    assert all(r["unfinished"] == 0 for r in runs.values())
    assert runs["idc-pd"]["wan_gb"] == 0 and runs["cdc-pd"]["wan_gb"] > 0


def test_the_router_sends_the_low_hit_tail_to_the_relay(runs):
    pdd, cdc = runs["pdd"], runs["cdc-pd"]
    assert pdd["pipelines"]["p-rld-md"] > 0.1 * pdd["requests"]
    assert cdc["pipelines"]["p-rld-md"] == 0 and cdc["rld_token_share"] == 0
    assert 0 < pdd["rld_token_share"] < 0.5
    assert sum(pdd["handoffs"].values()) == pdd["pipelines"]["p-rld-md"]


def test_the_relay_hides_the_wan_from_ttft(runs):
    assert runs["pdd"]["ttft_s"]["p90"] < runs["cdc-pd"]["ttft_s"]["p90"]


def test_hit_rate_is_an_outcome_of_drc_capacity():
    big = simulate(SMALL, "cdc-pd")
    prof = load_profile("report")
    tiny_chip = replace(prof.chips["bandwidth"], kv_budget_tokens=600_000)
    small = replace(prof, chips={**prof.chips, "bandwidth": tiny_chip})
    cramped = simulate(SMALL, "cdc-pd", profile=small)
    assert cramped["drc_evictions"] > big["drc_evictions"]
    assert cramped["md_hit"] < big["md_hit"] - 0.05
    assert cramped["wan_gb"] > big["wan_gb"]


def test_decode_capacity_costs_ttft():
    fast = simulate(SMALL, "idc-pd")
    slow = simulate(replace(SMALL, idc_decode_instances=1), "idc-pd")
    # One decoder runs 8× the batch: every step is longer, so every request's output is slower.
    assert slow["e2e_s"]["p50"] > fast["e2e_s"]["p50"]
    assert slow["busy"]["main_decode"] > 2 * fast["busy"]["main_decode"]


def test_same_seed_same_numbers():
    cfg = replace(SMALL, duration_s=40, warmup_s=0)
    assert simulate(cfg, "pdd") == simulate(cfg, "pdd")
    assert simulate(cfg, "pdd") != simulate(replace(cfg, seed=2), "pdd")


def test_sessions_reuse_their_history():
    reqs = workload(SMALL)
    by_rid = {r.rid: r for r in reqs}
    later = [r for r in reqs if r.reuse]
    assert len(later) > 0.5 * len(reqs)
    for r in later:
        if r.prev in by_rid and by_rid[r.prev].session == r.session:
            p = by_rid[r.prev]
            assert r.reuse == p.prompt + p.output < r.prompt
    mean = np.mean([r.prompt for r in reqs])
    assert 0.85 * 65536 < mean < 1.15 * 65536


def test_one_request_through_p_md_costs_what_the_profile_says():
    # One request alone: prefill its miss, the delta over the WAN, one MD step, the delay back.
    cfg = replace(SMALL, duration_s=1, rps=1, warmup_s=0, stream_kv=False)
    run = _Run(cfg, "cdc-pd", load_profile("report"))
    req = workload(cfg)[0]
    run.run([req])
    o = run.outcomes[0]
    prof = load_profile("report")
    p, md = prof.chips["flagship"], prof.chips["bandwidth"]
    pre = p.prefill_overhead_ms + p.prefill_ms(req.prompt, 0)
    chunks = -(-req.prompt // p.prefill_chunk_tokens)
    assert o.hit == 0 and o.sent_tokens == req.prompt
    wan = req.prompt * prof.kv_bytes_per_token / (20e9 / 8)
    step = md.decode_ms(1, req.prompt + (req.output - 1 - (req.output - 1)))
    lo = (p.prefill_ms(req.prompt, 0) + chunks * p.prefill_overhead_ms * 0.99) / 1e3
    assert o.transfer == pytest.approx(wan)
    assert o.ttft > lo + wan + 2 * 0.010
    assert o.ttft < (pre + chunks * p.prefill_overhead_ms) / 1e3 + wan + 0.020 + 2 * step / 1e3


def test_streamed_kv_overlaps_prefill_chunk_by_chunk():
    # One request alone, its KV streamed as each 16K-token chunk is computed: the delta lands at
    # max over chunks i of (chunk i computed + the link time of chunks i..k), then the delay.
    cfg = replace(SMALL, duration_s=1, rps=1, warmup_s=0)
    prof = load_profile("report")
    p = prof.chips["flagship"]
    req = workload(cfg)[0]
    ends, t, done = [], 0.0, 0
    while done < req.prompt:
        n = min(p.prefill_chunk_tokens, req.prompt - done)
        t += (p.prefill_overhead_ms + p.prefill_ms(n, done)) / 1e3
        done += n
        ends.append((t, n))
    assert len(ends) > 2
    wire = [n * prof.kv_bytes_per_token / (20e9 / 8) for _, n in ends]
    landed = max(te + sum(wire[i:]) for i, (te, _) in enumerate(ends))
    runs = {}
    for stream in (True, False):
        run = _Run(replace(cfg, stream_kv=stream), "cdc-pd", prof)
        run.run([req])
        runs[stream] = run.outcomes[0]
    o = runs[True]
    assert o.transfer == pytest.approx(sum(wire))  # the same bytes, alone on the link
    step = prof.chips["bandwidth"].decode_ms(1, req.prompt) / 1e3
    assert landed + 2 * 0.010 < o.ttft < landed + 2 * 0.010 + 2 * step
    assert o.ttft < runs[False].ttft - 0.5 * sum(wire[:-1])


def test_the_kv_size_on_the_wire_scales_the_wan_bytes():
    cfg = replace(SMALL, duration_s=1, rps=1, warmup_s=0)
    prof = load_profile("report")
    assert prof.sources["profile.kv_bytes_per_token"] and prof.sources["profile.kv_wire_ratio"]
    req = workload(cfg)[0]
    got = {}
    for name, c, p in (
        ("full", cfg, prof),
        ("half", cfg, replace(prof, kv_wire_ratio=0.5)),
        ("tenth", replace(cfg, kv_bytes_per_token=prof.kv_bytes_per_token // 10), prof),
    ):
        run = _Run(c, "cdc-pd", p)
        run.run([req])
        got[name] = (run.wan_bytes, run.outcomes[0].transfer)
    assert got["full"][0] == req.prompt * prof.kv_bytes_per_token  # a cold request sends it all
    assert got["half"] == pytest.approx((got["full"][0] / 2, got["full"][1] / 2))
    assert got["tenth"][0] == req.prompt * (prof.kv_bytes_per_token // 10)
    with pytest.raises(ValueError, match="kv_wire_ratio"):
        replace(prof, kv_wire_ratio=0.0)


def test_the_report_comparison_derives_its_column_b_from_the_transfer_table():
    from pdd.bench.sim_report import REPORT, TRANSFER_RPS, derived

    d = derived(SimConfig())
    # The saturated line: RPS 80 × 64K × 10 % miss × B = 20 Gbps; Little's law on the pool.
    assert d["kv_bytes_per_token"] == int(20e9 / 8 / (TRANSFER_RPS * 65536 * 0.10)) == 4768
    assert d["pool_streams"] == round(TRANSFER_RPS * REPORT["KV transfer P50 uniform ms"] / 1e3)


def test_the_stack_cost_delays_every_request():
    cfg = replace(SMALL, duration_s=1, rps=1, warmup_s=0)
    prof = load_profile("report")
    req = workload(cfg)[0]
    ttft = {}
    for ms in (0.0, 100.0):
        run = _Run(cfg, "cdc-pd", replace(prof, request_overhead_ms=ms))
        run.run([req])
        ttft[ms] = run.outcomes[0].ttft
    assert ttft[100.0] - ttft[0.0] == pytest.approx(0.100)


def test_cost_per_hour_prices_each_pool():
    prices = Prices(flagship=1.0, bandwidth=0.5, wan_line=0.1)
    cfg = SimConfig(prefill_instances=8, relay_instances=3, md_instances=8, remote_clusters=2)
    assert cost_per_hour(cfg, "pdd", prices) == pytest.approx(8 + 3 + 8 * 0.5 + 2 * 0.1)
    assert cost_per_hour(cfg, "cdc-pd", prices) == pytest.approx(8 + 8 * 0.5 + 2 * 0.1)
    idc = cost_per_hour(cfg, "idc-pd", prices)
    assert idc == cfg.idc_prefill_instances + cfg.idc_decode_instances


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["sim", "--dist", "uniform", "--duration-s", "30", "--warmup-s", "0", "--rps", "2"]
    assert main([*argv, "--modes", "cdc-pd,pdd", "--json", str(out)]) == 0
    assert "cdc-pd  uniform" in capsys.readouterr().out
    assert [r["mode"] for r in json.loads(out.read_text())["runs"]] == ["cdc-pd", "pdd"]


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--rps", "0"], "rps"),
        (["--modes", "xx"], "--modes"),
        (["--profile", "nope"], "profile"),
        (["--hit-threshold", "1.5"], "hit_threshold"),
    ],
)
def test_cli_bad_input_is_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sim", "--dist", "skewed", "--duration-s", "5", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert msg in err and "Traceback" not in err


@pytest.mark.parametrize(
    "field,value",
    [
        ("dist", "zipf"),
        ("rps", 0.0),
        ("hit_threshold", 1.5),
        ("output_scale", 0.5),
        ("local_prefill_tokens", -1),
        ("md_instances", 0),
        ("remote_clusters", 0),
    ],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})


def test_calibrate_fits_the_extend_slope_and_its_growth_with_the_prefix():
    from pdd.bench.calibrate import fit_extend

    a, att = 0.04, 800.0
    per_token, attention = fit_extend({c: a * (1 + c / att) for c in (512, 2048)})
    assert per_token == pytest.approx(a) and attention == pytest.approx(att)
    # a slope that does not grow (noise): the smaller one, and no attention term
    assert fit_extend({512: 0.06, 2048: 0.05}) == (0.05, 0.0)


def test_a_local_prefill_after_a_long_prefix_costs_its_attention():
    """MainDecode's local prefill of k tokens after c cached ones: with a calibrated attention
    term its step grows with c, as the engine's does; the report's chip (no term) stays flat."""
    from pdd.bench.sim_engine import DecodeInstance, Seq

    chip = load_profile("testbed").chips["cpu"]
    grown = replace(chip, extend_attention_tokens=800.0)
    assert grown.extend_chunk_ms(40, 2000) == pytest.approx(
        40 * chip.extend_ms_per_token * (1 + 2020 / 800)
    )
    flat = replace(chip, extend_attention_tokens=0.0)
    assert flat.extend_chunk_ms(40, 2000) == pytest.approx(40 * chip.extend_ms_per_token)

    def first_token_s(c: int, k: int, profile) -> float:
        loop = EventLoop()
        inst = DecodeInstance(loop, profile, "md")
        seen = []
        inst.submit(Seq(ctx=c + k, tokens=0, reserve=c + k + 1, prefill=k, first=seen.append))
        loop.run()
        return seen[0]

    assert first_token_s(2000, 40, grown) > 2 * first_token_s(0, 40, grown)
    assert first_token_s(2000, 40, flat) == pytest.approx(first_token_s(0, 40, flat))


def test_calibrate_keeps_each_stack_number_as_the_median_of_its_runs(capsys):
    from pdd.bench.calibrate import main as calibrate_main
    from pdd.bench.calibrate_stack import median_of

    runs = [
        {"a": (3.0, "run 0"), "b": (1.0, "b0")},
        {"a": (1.0, "run 1"), "b": (5.0, "b1")},
        {"a": (2.0, "run 2"), "b": (9.0, "b2")},
    ]
    got = median_of(runs)
    assert got["a"][0] == 2.0 and got["a"][1].endswith("that run: run 2")
    assert "median of 3 runs (3, 1, 2)" in got["a"][1]
    assert got["b"][0] == 5.0 and got["b"][1].endswith("b1")
    assert median_of(runs[:1]) == runs[0]
    with pytest.raises(SystemExit) as exited:
        calibrate_main(["--stack", "--repeats", "0", "--out", "p.json"])
    assert exited.value.code == 2 and "--repeats" in capsys.readouterr().err
