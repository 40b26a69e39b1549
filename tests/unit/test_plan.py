"""`pdd plan`: the frontier over pool sizes, and its bad input."""

from __future__ import annotations

import pytest

from pdd.bench.economics import Prices
from pdd.bench.plan import main, search
from pdd.bench.simulator import SimConfig


def test_search_marks_a_frontier():
    base = SimConfig(duration_s=60, warmup_s=10, live_sessions=64, rps=4)
    pts = search(base, [4], [1], [2, 4], [0.95], Prices(), steps=3)
    assert {p["mode"] for p in pts} == {"idc-pd", "pdd"}
    for mode in ("idc-pd", "pdd"):
        mine = [p for p in pts if p["mode"] == mode]
        assert any(p["frontier"] for p in mine)
        cheapest = min(mine, key=lambda p: p["cost"])
        assert cheapest["frontier"] or any(
            p["goodput_rps"] > cheapest["goodput_rps"] and p["cost"] <= cheapest["cost"]
            for p in mine
        )


@pytest.mark.parametrize(
    "argv,msg",
    [(["--md", "x"], "--md"), (["--prices", "1,2"], "--prices"), (["--md", "0"], "--md")],
)
def test_bad_input_is_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err.strip().splitlines()[-1]
