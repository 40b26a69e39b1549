"""The mode mapping (IDC-PD, CDC-PD, PDD → stack + load settings), the targets, and the CLI routing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdd import cli
from pdd.bench import calibrate, modes, targets
from pdd.bench.loadgen import LoadConfig
from pdd.bench.metrics import build_result, write_result
from pdd.bench.record import RequestResult
from pdd.testbed.stack import LinkSettings


def test_modes_differ_only_in_relays_and_link(tmp_path):
    tb = modes.Testbed(wan_mbps=25.0, wan_delay_ms=3.0, wan_jitter_ms=0.5)
    cfgs = {m: modes.stack_config(m, tb, log_dir=tmp_path) for m in modes.MODES}
    assert {m: c.relay for m, c in cfgs.items()} == {"idc-pd": 0, "cdc-pd": 0, "pdd": 1}
    assert cfgs["idc-pd"].wan == LinkSettings() and not cfgs["idc-pd"].wan.shaped
    assert cfgs["cdc-pd"].wan == cfgs["pdd"].wan == LinkSettings(25.0, 3.0, 0.5)
    # Everything else — model, engine and gateway flags, instance counts — is shared.
    base = dataclasses.replace(cfgs["pdd"], relay=0, wan=LinkSettings())
    assert (
        cfgs["idc-pd"] == base and dataclasses.replace(cfgs["cdc-pd"], wan=LinkSettings()) == base
    )
    flags = cfgs["pdd"].engine_flags
    assert (
        flags[flags.index("--block-size") + 1] == "16"
        and flags[flags.index("--threads") + 1] == "1"
    )
    assert cfgs["pdd"].main_decode_flags == ("--max-num-batched-tokens", "128")
    gw = cfgs["pdd"].gateway_flags
    assert gw[gw.index("--hit-threshold") + 1] == "0.95" and gw[gw.index("--seed") + 1] == "0"
    assert gw[gw.index("--local-prefill-tokens") + 1] == "256"
    assert (cfgs["pdd"].prefill, cfgs["pdd"].main_decode, cfgs["pdd"].model) == (
        1,
        1,
        modes.TESTBED_MODEL,
    )


def test_load_overrides_are_greedy_exact_length_and_force_p_md_without_a_relay():
    for mode in modes.MODES:
        o = modes.load_overrides(mode)
        assert o["temperature"] == 0.0 and o["ignore_eos"] is True
        cfg = LoadConfig(target="h:1", **o)  # the overrides are valid LoadConfig fields
        assert cfg.force_pipeline == ("" if mode == "pdd" else "p-md")


def test_link_record_and_environment():
    tb = modes.Testbed(wan_mbps=40.0, wan_delay_ms=1.0, catch_up_gap=7, pace_max_hold_ms=20.0)
    assert modes.link_record("idc-pd", tb) == {
        "mbps": 0.0,
        "delay_ms": 0.0,
        "jitter_ms": 0.0,
        "relays": 0,
        "model": tb.model,
    }
    assert (
        modes.link_record("pdd", tb)["mbps"] == 40.0 and modes.link_record("pdd", tb)["relays"] == 1
    )
    assert modes.stack_env(tb) == {
        "PDD_CATCH_UP_GAP": "7",
        "PDD_PACE_MAX_HOLD_MS": "20.0",
        "PDD_STREAM_LEAD_MS": "auto",
    }
    assert modes.stack_env(modes.Testbed(stream_lead_ms=0.0))["PDD_STREAM_LEAD_MS"] == "0.0"


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(wan_mbps=0.0), "wan_mbps"),
        (dict(threads=0), "threads"),
        (dict(hit_threshold=1.5), "hit_threshold"),
        (dict(wan_delay_ms=-1.0), "wan_delay_ms"),
        (dict(catch_up_gap=-1), "catch_up_gap"),
        (dict(pace_max_hold_ms=-1.0), "pace_max_hold_ms"),
        (dict(model=""), "model"),
        (dict(stream_lead_ms=-1.0), "stream_lead_ms"),
        (dict(local_prefill_tokens=-1), "local_prefill_tokens"),
        (dict(md_max_batched_tokens=0), "md_max_batched_tokens"),
    ],
)
def test_testbed_rejects_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        modes.Testbed(**bad)


def test_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        modes.stack_config("pd", modes.Testbed(), log_dir=tmp_path)


def test_kv_bytes_and_transfer_steps():
    assert calibrate.kv_bytes_per_token(modes.TESTBED_MODEL) == 2 * 4 * 2 * 64 * 4
    # wan_bytes: 10 Mbps moves 1250 bytes per ms.
    recs = [
        RequestResult(
            request_id=str(i), actual_hit=h, wan_transfer_ms=t, wan_bytes=int(t * 1250 / 2)
        )
        for i, (h, t) in enumerate(
            [(0.5, 1000.0), (0.7, 600.0), (0.9, 200.0), (0.97, 50.0), (0.99, 30.0)]
        )
    ]
    recs.append(
        RequestResult(
            request_id="bad",
            actual_hit=0.1,
            wan_transfer_ms=5000.0,
            wan_bytes=10**6,
            error_code="UNAVAILABLE",
        )
    )
    recs.append(
        RequestResult(request_id="none", actual_hit=0.99, wan_transfer_ms=3.0)
    )  # nothing sent
    steps = calibrate.transfer_steps(recs, step_ms=10.0)
    assert steps["low_hit"] == {"requests": 3, "p50": 60.0, "max": 100.0}
    assert steps["high_hit"] == {"requests": 2, "p50": 4.0, "max": 5.0}
    link = calibrate.transfer_steps(
        recs, step_ms=10.0, mbps=10.0
    )  # bytes ÷ bandwidth: half the push times
    assert link["low_hit"] == {"requests": 3, "p50": 30.0, "max": 50.0}
    assert calibrate.link_ms(2_500_000, 20.0) == pytest.approx(1000.0)


def _result(mode, ttfdt_p90_ms, rld=0.0, gap=None, itl=10.0, errors=0, outputs=None) -> dict:
    recs = []
    for i in range(10):
        t = ttfdt_p90_ms * (i + 1) / 9.1  # the P90 of 10 linear values lands on ttfdt_p90_ms
        stage = "relay" if rld else "main_decode"
        recs.append(
            RequestResult(
                request_id=f"r{i}",
                ttft_ms=50.0,
                token_times_ms=[50.0, t, t + itl],
                token_stages=["prefill", stage, "main_decode"],
                itl_ms=[t - 50.0, itl],
                output_token_ids=(outputs or {}).get(f"r{i}", [i, i + 1, i + 2]),
                rld_tokens=1 if rld else 0,
                md_tokens=1 if rld else 2,
                handoff_gap_ms=gap,
            )
        )
    recs += [RequestResult(request_id=f"e{i}", error_code="UNAVAILABLE") for i in range(errors)]
    return build_result(mode, recs, 10.0)


def test_targets_judge_pdd_against_both_baselines():
    results = [
        _result("idc-pd", 1000.0),
        _result("cdc-pd", 2000.0),
        _result("pdd", 1050.0, rld=0.5, gap=25.0),
    ]
    ts = {t.name: t for t in targets.evaluate(results)}
    assert ts["pdd P90 TTFDT ÷ cdc-pd"].value == pytest.approx(1050 / 2000, rel=1e-3)
    assert ts["pdd P90 TTFDT ÷ cdc-pd"].met and ts["pdd P90 TTFDT ÷ idc-pd"].met
    assert ts["pdd P90 TTFT (prefill's token) ÷ cdc-pd"].met is None  # information only
    assert ts["RLD token share"].value == pytest.approx(0.5) and ts["RLD token share"].met is False
    gap = ts["handoff gap P99 ÷ median ITL"]
    assert gap.met is True and gap.value == pytest.approx(25.0 / results[2]["itl_ms"]["p50"])
    assert (
        ts["errors, all modes"].met
        and ts["identical greedy outputs across modes (up to near-ties)"].met
    )
    assert not targets.all_met(list(ts.values()))
    assert "MISSED RLD token share" in ts["RLD token share"].line()


def test_targets_catch_errors_divergence_and_missing_handoffs():
    results = [
        _result("cdc-pd", 1000.0, errors=1),
        _result("pdd", 900.0, outputs={"r3": [9, 9, 9]}),
    ]
    ts = {t.name: t for t in targets.evaluate(results)}
    assert ts["pdd P90 TTFDT ÷ cdc-pd"].met is False  # 0.9 > 0.55
    assert "pdd P90 TTFDT ÷ idc-pd" not in ts  # no idc-pd run: nothing to judge
    assert ts["errors, all modes"].met is False and ts["errors, all modes"].value == 1
    assert ts["identical greedy outputs across modes (up to near-ties)"].value == pytest.approx(0.9)
    assert (
        ts["handoff gap P99 ÷ median ITL"].met is False
        and "no request handed off" in ts["handoff gap P99 ÷ median ITL"].detail
    )


def test_cli_routes_trace_and_bench_tools(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert (
        cli.main(
            [
                "trace",
                "gen",
                "--sessions",
                "2",
                "--turns",
                "2",
                "--prompt-tokens",
                "64",
                "--max-context",
                "512",
                "--vocab-high",
                "500",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4 and max(max(x["prompt_token_ids"]) for x in lines) < 500
    paths = []
    for r in (_result("cdc-pd", 2000.0), _result("pdd", 1000.0, rld=0.5, gap=20.0)):
        write_result(r, tmp_path / f"{r['mode']}.json")
        paths.append(str(tmp_path / f"{r['mode']}.json"))
    capsys.readouterr()
    assert cli.main(["bench", "compare", *paths]) == 0
    text = capsys.readouterr().out
    assert "TTFDT P90 (ms)" in text and "pdd P90 TTFDT ÷ cdc-pd: 0.50" in text
    assert cli.main(["bench", "--help"]) == 0
    assert "compare" in capsys.readouterr().out
    assert cli.main(["trace"]) == 2
    with pytest.raises(SystemExit):  # `pdd bench` alone is `pdd bench run`, which needs --trace
        cli.main(["bench"])


def test_in_flight_is_the_time_average_and_peak_of_open_requests():
    from pdd.bench.demo import in_flight

    recs = [
        RequestResult("a", start_ms=0.0, e2el_ms=10.0),
        RequestResult("b", start_ms=5.0, e2el_ms=10.0),
        RequestResult("c", start_ms=20.0, e2el_ms=5.0),
        RequestResult("d", start_ms=1.0),
    ]  # d: no e2el
    # [0,5): 1, [5,10): 2, [10,15): 1, [15,20): 0, [20,25): 1 → 25 request·ms over 25 ms.
    assert in_flight(recs) == (pytest.approx(1.0), 2)
    assert in_flight([]) == (0.0, 0)


def test_divergences_are_classified_against_the_reference():
    from pdd.bench.agreement import divergences
    from pdd.bench.trace import OutputSlot, TraceRequest
    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine
    from pdd.engine.sampling import SamplingParams
    from pdd.serving.model_spec import load_model

    model = "tiny:3,vocab=512,hidden=64,inter=128,layers=2,heads=4,kv_heads=2,ctx=1024"
    engine = Engine(load_model(model), EngineConfig(block_size=8))
    p0, p1 = list(range(10, 40)), list(range(50, 70))
    greedy0 = engine.generate([p0], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    greedy1 = engine.generate([p1], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    t0 = TraceRequest("a-t0", "a", 0.0, p0, 6, 0.0)
    t1 = TraceRequest(
        "a-t1",
        "a",
        1.0,
        p0 + [0] * 6 + [77, 78],
        3,
        0.9,
        turn=1,
        output_slots=(OutputSlot(len(p0), 6, "a-t0"),),
    )
    other = TraceRequest("b-t0", "b", 0.0, p1, 4, 0.0)
    wrong = greedy0[:2] + [(greedy0[2] + 1) % 512] + greedy0[3:]  # not the argmax: a clear margin
    outputs = {
        "idc-pd": {"a-t0": greedy0, "a-t1": [1, 2, 3], "b-t0": greedy1},
        "pdd": {"a-t0": wrong, "a-t1": [1, 2, 4], "b-t0": greedy1},
    }
    found = {d.request_id: d for d in divergences([t0, t1, other], outputs, model)}
    assert set(found) == {"a-t0", "a-t1"}  # b-t0 agrees
    assert found["a-t1"].kind == "cascade"  # its prompt embeds a-t0's differing output
    real = found["a-t0"]
    assert (real.kind, real.position) == ("real", 2) and real.margin >= 1e-3
    assert dict(real.tokens) == {"idc-pd": greedy0[2], "pdd": wrong[2]}
    ts = {
        t.name: t
        for t in targets.evaluate(
            [_result("idc-pd", 100.0), _result("pdd", 100.0, outputs={"r1": [0, 0, 0]})],
            divergences=[real],
        )
    }
    assert ts["identical greedy outputs across modes (up to near-ties)"].met is False
    assert "1 real" in ts["identical greedy outputs across modes (up to near-ties)"].detail


def test_a_near_tie_divergence_is_accepted_and_said():
    from pdd.bench.agreement import Divergence

    results = [_result("idc-pd", 100.0), _result("pdd", 100.0, outputs={"r1": [1, 9, 9]})]
    tie = Divergence("r1", "near-tie", 1, (("idc-pd", 2), ("pdd", 9)), 5e-6)
    t = next(
        t for t in targets.evaluate(results, divergences=[tie]) if t.name.startswith("identical")
    )
    assert t.met is True and t.value == pytest.approx(0.9)
    assert (
        "1 at a near-tie" in t.detail
        and "r1: near-tie at output 1" in t.detail
        and "5.0e-06" in t.detail
    )
    # An unexplained difference (no analysis given) misses.
    t = next(t for t in targets.evaluate(results) if t.name.startswith("identical"))
    assert t.met is False


def test_the_prefill_fit_recovers_the_simulators_model_and_its_attention_term():
    # timings made by the simulator's own prefill model (sim_profile.ChipProfile.prefill_ms)
    from pdd.bench.sim_profile import load_profile

    chip = dataclasses.replace(
        load_profile("testbed").chip("cpu"),
        prefill_tokens_per_s=20_000.0,
        prefill_attention_tokens=900.0,
        prefill_overhead_ms=4.0,
    )
    whole = {n: 4.0 + chip.prefill_ms(n, 0) for n in (128, 512, 2048)}
    after = {(c, k): 4.0 + chip.prefill_ms(k, c) for c, k in ((1024, 32), (2048, 64))}
    o, rate, attention = calibrate.fit_prefill(whole, after)
    assert (o, rate, attention) == (
        pytest.approx(4.0, abs=1e-6),
        pytest.approx(20_000.0),
        pytest.approx(900.0),
    )
    # a short suffix after a long cached prefix costs what the model says it does
    assert 4.0 + chip.prefill_ms(32, 2048) == pytest.approx(
        o + 32 / rate * 1e3 * (1 + (2048 + 16) / attention)
    )
