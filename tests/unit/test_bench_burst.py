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
