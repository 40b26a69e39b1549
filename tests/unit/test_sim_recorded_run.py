"""Recording a bench run for the simulator's check, and the served stages' cost per step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdd.bench import sim_validate as sv
from pdd.bench.calibrate_stack import cpu_ms_per_token
from pdd.bench.record import RequestResult
from pdd.bench.sim_engine import DecodeInstance, Seq
from pdd.bench.sim_link import EventLoop
from pdd.bench.sim_profile import load_profile
from pdd.bench.sim_validate import MODES, RECORDED, digest, recorded_requests, validate
from pdd.bench.simulator import _Run
from pdd.bench.trace import TraceRequest, write_trace

SYSTEM = list(range(100, 400))  # one shared system prompt, 300 tokens


def _first_turn(sid: str, t: float, shared: int, seen: int, fresh: int) -> TraceRequest:
    prompt = SYSTEM[:shared] + [5000 + i for i in range(fresh)]
    n = len(prompt)
    return TraceRequest(f"{sid}-t00", sid, t, prompt, 8, round(min(shared, seen) / n, 6))


def _demo_folder(tmp_path):
    """A `pdd demo` folder's shape: the trace and one RESULT per mode."""
    trace = [
        _first_turn("s0", 0.0, shared=200, seen=0, fresh=50),  # the first request: hit 0
        _first_turn("s1", 100.0, shared=250, seen=200, fresh=50),
        TraceRequest("s0-t01", "s0", 300.0, SYSTEM[:200] + [7] * 60, 8, 0.9),
    ]
    trace[2] = replace(trace[2], turn=1)
    write_trace(trace, tmp_path / "trace.jsonl")
    for mode in MODES:
        result = {
            "ttfdt_ms": {"p50": 10.0, "p90": 20.0},
            "rld_token_share": 0.05 if mode == "pdd" else None,
            "pipelines": {"p-md": 3},
            "duration_s": 1.0,
            "itl_ms": {"p50": 4.0},
            "link": {"mbps": 80.0},
            "cpu": {"wall_s": 1.0, "services": {}},
        }
        (tmp_path / f"{mode}.json").write_text(json.dumps(result))
    return tmp_path


def test_digest_keeps_each_first_turns_system_prompt_length(tmp_path):
    d = digest(_demo_folder(tmp_path))
    rows = [dict(zip(d["columns"], r)) for r in d["trace"]]
    # s0's own hit is 0 (nothing before it), but the 200 system tokens it shares with s1 are what
    # a cache holding s0 serves s1; s1's 250 share 200 with s0 (the 50 beyond are its own).
    assert [(r["session_id"], r["expected_hit"], r["system_tokens"]) for r in rows] == [
        ("s0", 0.0, 200),
        ("s1", round(200 / 300, 6), 200),
        ("s0", 0.9, 0),
    ]
    assert d["results"]["pdd"]["rld_token_share"] == 0.05
    assert d["results"]["idc-pd"]["rld_token_share"] == 0.0
    reqs = recorded_requests(d)
    assert [r.system for r in reqs] == [200, 200, 200]  # a later turn keeps its session's


def test_the_replay_routes_the_recorded_pipelines():
    # NOTE: with the system prompt's length taken from the first turn's own hit (0 for the very
    # first request) the caches never held it: one request too many went P-RLD-MD (33 MD / 7).
    d = json.loads(RECORDED.read_text())
    run = _Run(sv.testbed_config(d, "testbed"), "pdd", load_profile("testbed"))
    run.run(recorded_requests(d))
    got = {p: sum(o.pipeline == p for o in run.outcomes) for p in ("md", "p-md", "p-rld-md")}
    want = d["results"]["pdd"]["pipelines"]
    assert {k: v for k, v in got.items() if v} == want


def test_the_stream_cost_lengthens_every_decode_step():
    chip = load_profile("testbed").chips["cpu"]
    ends = {}
    for ms in (0.0, 2.0):
        loop = EventLoop()
        inst = DecodeInstance(loop, chip, "md0", stream_ms=ms)
        inst.submit(Seq(ctx=100, tokens=10, reserve=111))
        loop.run()
        ends[ms] = inst.step_ends[-1]
    assert ends[2.0] - ends[0.0] == pytest.approx(10 * 2.0 / 1e3)


def test_a_slower_relay_step_leaves_it_fewer_tokens_before_the_handoff():
    prof = load_profile("testbed")
    share = {}
    for ms in (0.0, 3.0):
        p = replace(prof, relay_stream_ms_per_step=ms)
        rows = {(r["mode"], r["metric"]): r for r in validate(profile_obj=p)}
        share[ms] = rows["pdd", "RLD share %"]["simulated"]
        # MainDecode's steps are untouched: IDC-PD does not move
        assert rows["idc-pd", "TTFDT P50 ms"]["simulated"] == pytest.approx(
            {(r["mode"], r["metric"]): r for r in validate()}["idc-pd", "TTFDT P50 ms"]["simulated"]
        )
    assert share[3.0] < 0.8 * share[0.0]


def test_cpu_per_token_splits_the_run_by_stage():
    recs = [
        RequestResult("a", pipeline="p-rld-md", rld_tokens=100, md_tokens=300),
        RequestResult("b", pipeline="md", md_tokens=600),
        RequestResult("c", pipeline="md", md_tokens=999, error_code="UNAVAILABLE"),
    ]
    result = {
        "cpu": {
            "wall_s": 10.0,
            # cores used over the 10 s: 0.03 × 10 s = 0.3 s of relay CPU over its 100 tokens
            "services": {
                "relay-0": 0.03,
                "main_decode-0": 0.27,
                "gateway": 0.02,
                "bench_client": 0.01,
                "wan-0": 0.01,
            },
        }
    }
    got = cpu_ms_per_token(result, recs)
    assert got["relay"] == pytest.approx(3.0)
    assert got["main_decode"] == pytest.approx(2.7e3 / 900)
    assert got["main_side"] == pytest.approx(0.3e3 / 1000)
    assert got["wan"] == pytest.approx(0.1e3 / 1000)


def test_cli_digests_a_demo_folder_and_validates_against_it(tmp_path, capsys):
    from pdd.bench.sim_command import main

    out = tmp_path / "run.json"
    assert main(["--digest", str(_demo_folder(tmp_path)), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["columns"][-1] == "system_tokens"
    capsys.readouterr()
    main(["--validate", "--recorded", str(out)])  # the replay of that run, not the stored one
    table = capsys.readouterr().out
    assert "pdd     TTFDT P90 ms       20.0" in table and "149.3" not in table
    with pytest.raises(SystemExit):
        main(["--digest", str(tmp_path / "nothing")])  # no --json: a one-line usage error
    assert "--digest" in capsys.readouterr().err


def test_the_link_meters_view_busy_throughput_and_outstanding_bytes():
    from pdd.bench.sim_link import SimLink
    from pdd.bench.sim_push import WanPush

    loop = EventLoop()
    link = SimLink(loop, bytes_per_s=1e9, streams=2)
    landed = []
    push = WanPush(loop, link, 1e6, 0, lambda: landed.append(loop.now))
    push.expect(3e9)  # 3,000 tokens of 1 MB
    loop.at(1.0, lambda: push.feed(1000))  # idle before: not busy time
    loop.at(1.5, lambda: (push.feed(3000), push.close()))
    seen = []
    loop.at(1.5, lambda: (link.sync(), seen.append((link.outstanding, link.measured_bps))))
    loop.run()
    assert seen == [(pytest.approx(3e9), pytest.approx(1e9))]  # 0.5 GB moved in 0.5 busy s
    assert landed == [pytest.approx(4.0)] and link.outstanding == pytest.approx(0.0)
    assert link.measured_bps == pytest.approx(1e9)


def test_the_replay_routes_the_low_hit_turns_as_the_live_gateway_did():
    # The recorded run's gateway (link-aware, budget 3 × its median TTFT) sent its six low-hit
    # first turns through the relay: the first two before prefill's heartbeat had reported the
    # link (θ), the other four because their deltas take ~0.2 s against a ~90 ms budget. The
    # absolute 0.5 s budget the router had before would have sent those four P-MD.
    d = json.loads(RECORDED.read_text())
    cols = d["columns"]
    sid = [dict(zip(cols, r))["session_id"] for r in sorted(d["trace"], key=lambda r: r[0])]
    got = {}
    for name, change in (
        ("threshold", dict(pipeline_policy="threshold")),
        ("link_aware", {}),
        ("absolute", dict(ttft_budget_ratio=0.0)),
    ):
        cfg = replace(sv.testbed_config(d, "testbed"), **change)
        run = _Run(cfg, "pdd", load_profile("testbed"))
        run.run(recorded_requests(d))
        got[name] = {(sid[o.req.rid], o.pipeline) for o in run.outcomes if o.pipeline != "md"}
    first, later = {"s0000", "s0001"}, {"s0003", "s0006", "s0007", "s0009"}
    assert got["link_aware"] == got["threshold"] == {(s, "p-rld-md") for s in first | later}
    assert got["absolute"] == {(s, "p-rld-md") for s in first} | {(s, "p-md") for s in later}


def test_the_served_prefill_factor_is_read_from_prefills_own_log(tmp_path):
    from pdd.bench.calibrate_stack import prefill_factor, prefills

    fitted = replace(
        load_profile("testbed").chip("cpu"),
        prefill_overhead_ms=4.0,
        prefill_tokens_per_s=10_000.0,
        prefill_attention_tokens=1e12,  # no attention term: 0.1 ms a token
    )
    chip = {k: (v, "a source") for k, v in vars(fitted).items()}  # as measure_engine gives it
    lines = [
        {
            "event": "prefilled",
            "request_id": "warm-up-p-md-1",
            "prompt_tokens": 9,
            "cached_tokens": 0,
            "prefill_ms": 999.0,
        },
        {
            "event": "prefilled",
            "request_id": "a",
            "prompt_tokens": 1060,
            "cached_tokens": 1000,
            "prefill_ms": 15.0,
        },
        {
            "event": "prefilled",
            "request_id": "b",
            "prompt_tokens": 160,
            "cached_tokens": 0,
            "prefill_ms": 40.0,
        },
        {
            "event": "prefilled",
            "request_id": "c",
            "prompt_tokens": 96,
            "cached_tokens": 0,
            "prefill_ms": 27.0,
        },
        {"event": "prefill_refused", "request_id": "d"},
    ]
    log = tmp_path / "prefill-0.log"
    log.write_text("\n".join(json.dumps(e) for e in lines) + "\nnot json\n")
    served = prefills(log)
    assert [e["request_id"] for e in served] == ["a", "b", "c"]  # the warm-up left out
    # bare: a 4 + 6 = 10 ms (1.5×), b 4 + 16 = 20 (2×), c 4 + 9.6 = 13.6 (~1.99×): the median
    assert prefill_factor(served, chip) == pytest.approx(27.0 / 13.6)
    with pytest.raises(RuntimeError, match="no request"):
        prefill_factor([], chip)
    assert prefills(tmp_path / "missing.log") == []


def test_the_prefill_stack_factor_slows_only_the_prefill_stage():
    d = json.loads(RECORDED.read_text())
    cfg = sv._unshaped(sv._no_local(sv.testbed_config(d, "testbed")))
    prof = load_profile("testbed")
    ttft = {}
    for factor in (1.0, 2.0):
        run = _Run(cfg, "idc-pd", replace(prof, prefill_stack_factor=factor))
        run.run(recorded_requests(d))
        ttft[factor] = sorted(o.ttft for o in run.outcomes)
        busy = run.prefill[0].busy_s
        ttft[factor, "busy"] = busy
    assert ttft[2.0, "busy"] > 1.7 * ttft[1.0, "busy"]  # the overhead per step is not scaled
    assert all(b > a for a, b in zip(ttft[1.0], ttft[2.0]))
