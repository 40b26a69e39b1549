"""``pdd bench burst``'s arithmetic: capacity, goodput against it, refusals, hung requests and
the TTFT percentiles, from synthetic outcomes."""

from __future__ import annotations

import pytest

from pdd.bench.burst import COMPLETED, DEADLINE, REFUSED, BurstConfig, Outcome, main, report


def test_report_counts_each_outcome_against_capacity():
    cfg = BurstConfig(capacity_s=10.0, duration_s=4.0)
    cap = [Outcome(COMPLETED, 0.0, 1.0, 0.1 * (i + 1)) for i in range(20)]  # 2 completed/s
    cap.append(Outcome("UNAVAILABLE", 0.0, 0.1, None))
    burst = (
        [Outcome(COMPLETED, 0.0, 2.0, 0.5)] * 6
        + [Outcome(REFUSED, 1.0, 1.2, None)] * 3
        + [Outcome(REFUSED, 1.0, 1.6, None)]
        + [Outcome(DEADLINE, 0.5, 8.5, 0.3)] * 2
        + [Outcome("INTERNAL", 0.5, 0.6, None)]
    )
    r = report(cfg, cap, burst)
    assert r["capacity_rps"] == 2.0 and r["capacity_errors"] == {"UNAVAILABLE": 1}
    assert (r["offered"], r["offered_rps"]) == (13, 3.25)
    assert (r["completed"], r["completed_rps"], r["goodput_vs_capacity"]) == (6, 1.5, 0.75)
    assert r["refused"] == 4 and r["refusal_ms_p50"] == 200.0 and r["refusal_ms_max"] == 600.0
    assert r["hung_past_deadline"] == 2 and r["other_errors"] == {"INTERNAL": 1}
    assert r["ttft_ms_at_capacity"]["p50"] == pytest.approx(1050.0)
    assert r["ttft_ms_accepted_in_burst"] == {"p50": 500.0, "p90": 500.0}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"factor": 0}, "factor"),
        ({"deadline_s": -1}, "deadline_s"),
        ({"prompt_tokens": (5, 2)}, "prompt_tokens"),
    ],
)
def test_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        BurstConfig(**kwargs)


def test_a_bad_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["burst", "--factor", "0"])
    assert exc.value.code == 2 and "factor: must be positive" in capsys.readouterr().err


def _report(**over):
    r = {
        "capacity_rps": 10.0,
        "completed_rps": 9.5,
        "goodput_vs_capacity": 0.95,
        "refused": 40,
        "refusal_ms_max": 300.0,
        "hung_past_deadline": 0,
        "other_errors": {},
        "ttft_ms_at_capacity": {"p50": 200.0, "p90": 400.0},
        "ttft_ms_accepted_in_burst": {"p50": 300.0, "p90": 700.0},
    }
    r.update(over)
    return r


def test_the_verdict_passes_a_clean_burst_and_fails_each_way_it_can_go_wrong():
    from pdd.bench.burst_checks import BurstBar, burst_checks

    ok = burst_checks(_report(), dead=[], held={"relay-0 requests_held": 0})
    assert [c.name for c in ok] == [
        "survived", "no_hang", "fast_refusal", "goodput", "ttft_shape", "idle_after",
    ] and all(c.ok for c in ok), ok  # fmt: skip

    def failed(report, **kw):
        return {c.name for c in burst_checks(report, **kw) if not c.ok}

    assert failed(_report(), dead=["relay-0"], held={}) == {"survived"}
    assert failed(_report(hung_past_deadline=3)) == {"no_hang"}
    assert failed(_report(other_errors={"INTERNAL": 1})) == {"no_hang"}
    assert failed(_report(refusal_ms_max=1500.0)) == {"fast_refusal"}
    assert failed(_report(refused=0, refusal_ms_max=None)) == set()
    assert failed(_report(goodput_vs_capacity=0.6, completed_rps=6.0)) == {"goodput"}
    assert failed(_report(goodput_vs_capacity=None)) == {"goodput"}
    slow = {"p50": 250.0, "p90": 900.0}  # P90 2.25 x capacity's
    assert failed(_report(ttft_ms_accepted_in_burst=slow)) == {"ttft_shape"}
    assert failed(_report(ttft_ms_accepted_in_burst={"p50": None, "p90": None})) == {"ttft_shape"}
    assert failed(_report(), held={"main_decode-0 holds_requests": 2}) == {"idle_after"}
    # Against an external gateway neither survival nor holdings are known: not judged.
    assert {c.name for c in burst_checks(_report())} == {
        "no_hang", "fast_refusal", "goodput", "ttft_shape",
    }  # fmt: skip
    loose = BurstBar(goodput=0.5, refusal_s=2.0, ttft_factor=3.0)
    assert failed(_report(goodput_vs_capacity=0.6, refusal_ms_max=1500.0), bar=loose) == set()
    with pytest.raises(ValueError, match="^goodput:"):
        BurstBar(goodput=1.5)


def test_own_stack_flags_are_checked_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--own-stack", "--model", "/no/such/model"])
    assert exc.value.code == 2 and "model: /no/such/model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--own-stack", "--ttft-factor", "0"])
    assert exc.value.code == 2 and "ttft_factor: must be > 0" in capsys.readouterr().err
