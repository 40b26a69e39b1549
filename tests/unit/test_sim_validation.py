"""The simulator against the recorded `pdd bench` run (profiles/demo_run.json, testbed profile)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdd.bench.sim_profile import load_profile, parse_profile
from pdd.bench.sim_validate import RECORDED, TOLERANCE, recorded_requests, validate


@pytest.fixture(scope="module")
def rows():
    return {(r["mode"], r["metric"]): r for r in validate()}


def test_the_recorded_run_replays_request_for_request():
    d = json.loads(RECORDED.read_text())
    reqs = recorded_requests(d)
    assert len(reqs) == len(d["trace"]) == 40
    assert all(r.prev < r.rid for r in reqs)


def test_the_simulator_orders_the_modes_as_the_bench_measured(rows):
    p90 = {m: rows[m, "TTFDT P90 ms"]["simulated"] for m in ("idc-pd", "cdc-pd", "pdd")}
    rec = {m: rows[m, "TTFDT P90 ms"]["recorded"] for m in ("idc-pd", "cdc-pd", "pdd")}
    assert sorted(p90, key=p90.get) == sorted(rec, key=rec.get)
    assert rows["pdd", "RLD share %"]["simulated"] > 0
    assert rows["cdc-pd", "RLD share %"]["simulated"] == 0


def test_with_the_measured_stack_cost_every_figure_is_within_tolerance(rows):
    # The profile's request_overhead_ms / md_request_overhead_ms / prefill_stack_factor
    # (`pdd bench calibrate --stack`, each the median of 3 runs), and MainDecode's local prefill
    # attending to its cached prefix (``extend_attention_tokens``).
    assert len(rows) == 9
    bad = {k: round(r["error"], 2) for k, r in rows.items() if abs(r["error"]) > TOLERANCE}
    assert not bad


def test_the_stack_cost_is_what_closed_the_gap(rows):
    """Without the stack's own cost per request every mode's P50 falls by over 15 % of the
    recorded figure, and PDD's (its MD-only requests: a few ms of compute) out of tolerance."""
    prof = load_profile("testbed")
    assert prof.request_overhead_ms > 0 and prof.md_request_overhead_ms > 0
    bare = replace(prof, request_overhead_ms=0.0, md_request_overhead_ms=0.0)
    without = {(r["mode"], r["metric"]): r for r in validate(profile_obj=bare)}
    for mode in ("idc-pd", "cdc-pd", "pdd"):
        key = (mode, "TTFDT P50 ms")
        assert rows[key]["error"] - without[key]["error"] > 0.15
    assert without["pdd", "TTFDT P50 ms"]["error"] < -TOLERANCE


def test_the_local_prefills_attention_is_what_brought_pdds_p50_in(rows):
    """MainDecode's local prefill of an MD-only request attends to its cached prefix (1-3 K
    tokens here): priced flat at the no-prefix slope, PDD's P50 falls out of tolerance."""
    prof = load_profile("testbed")
    chip = prof.chips["cpu"]
    assert chip.extend_attention_tokens > 0
    flat = replace(prof, chips={"cpu": replace(chip, extend_attention_tokens=0.0)})
    without = {(r["mode"], r["metric"]): r for r in validate(profile_obj=flat)}
    assert (
        without["pdd", "TTFDT P50 ms"]["error"] < -TOLERANCE < rows["pdd", "TTFDT P50 ms"]["error"]
    )


def test_profiles_give_every_number_a_source():
    for name in ("report", "testbed"):
        prof = load_profile(name)
        assert prof.sources and all(s.strip() for s in prof.sources.values())
    with pytest.raises(ValueError, match="source"):
        parse_profile({"kv_bytes_per_token": {"value": 1, "source": ""}, "chips": {}, "link": {}})


def test_validate_replays_with_the_profile_named(capsys):
    from pdd.bench import sim_command

    # the report's profile has no chip for this machine: named, it is the one the replay loads
    with pytest.raises(SystemExit) as exited:
        sim_command.main(["--validate", "--profile", "report"])
    assert exited.value.code == 2
    assert "chip: 'cpu' not in profile 'report'" in capsys.readouterr().err
