"""``pdd bench served``'s ceiling: the throughput a contender's CPU a token allows on the host."""

from __future__ import annotations

import pytest

from pdd.bench.served import Round, summarize
from pdd.bench.served_ceiling import ceiling, ceiling_table, cpu_totals
from pdd.bench.served_contenders import CLIENT


def test_cpu_totals_count_every_process_the_client_too():
    t = cpu_totals({"gateway": 0.5, "main_decode-0": 2.5, CLIENT: 1.0}, wall_s=2.0, tokens=1000)
    assert t["cpu_ms_per_token_all"] == pytest.approx(4.0)
    assert t["busy_cores"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "cpu, wall, tokens",
    [
        ({"gateway": 0.5, "main_decode-0": None}, 2.0, 1000),  # a part unread: no lower total
        ({}, 2.0, 1000),
        ({"engine": 1.0}, 0.0, 1000),
        ({"engine": 1.0}, 2.0, 0),
        ({"engine": 0.0, CLIENT: 0.0}, 0.05, 100),  # a round shorter than a clock tick
    ],
)
def test_cpu_totals_are_unknown_rather_than_partial(cpu, wall, tokens):
    assert cpu_totals(cpu, wall, tokens) == {"cpu_ms_per_token_all": None, "busy_cores": None}


def test_ceiling_at_the_engines_busy_cores_and_at_every_core():
    engine = {"busy_cores": 1.8, "cpu_ms_per_token_all": 3.0, "mean_tok_s": 600.0}
    stack = {"busy_cores": 1.6, "cpu_ms_per_token_all": 4.0, "mean_tok_s": 400.0}
    c = ceiling(stack, engine, cores=2)
    assert c["at_engine"] == pytest.approx(450.0)  # 1.8 cores / 4 ms a token
    assert c["at_cores"] == pytest.approx(500.0)  # 2 cores / 4 ms a token
    assert c["achieved"] == pytest.approx(400.0 / 450.0)
    # The engine against itself: its ceiling is what it served.
    assert ceiling(engine, engine, 2)["achieved"] == pytest.approx(1.0)
    assert ceiling(stack, None, 2)["at_engine"] is None
    assert ceiling(stack, {"busy_cores": 0.0}, 2)["achieved"] is None  # no share of nothing
    assert ceiling({"cpu_ms_per_token_all": None}, engine, 2) == {
        "at_engine": None,
        "at_cores": None,
        "achieved": None,
    }


def _round(name: str, wall: float, tokens: int, cpu: dict) -> Round:
    return Round(name, 16, wall, tokens, 0, (10.0,), (2.0,), (0.5,), cpu)


def test_summaries_carry_what_the_table_needs():
    s = summarize(
        [
            _round("grpc-p-md", 2.0, 1000, {"gateway": 0.2, "main_decode-0": 2.6, CLIENT: 0.2}),
            _round("grpc-p-md", 3.0, 1000, {"gateway": 0.3, "main_decode-0": 3.9, CLIENT: 0.3}),
        ]
    )
    assert s["mean_tok_s"] == pytest.approx(2000 / 5.0)  # tokens over wall, not a median
    assert s["cpu_ms_per_token_all"] == pytest.approx(1000 * 7.5 / 2000)
    assert s["busy_cores"] == pytest.approx(7.5 / 5.0)
    assert s["cpu_ms_per_token_total"] == pytest.approx(1000 * 7.0 / 2000)  # services only


def test_table_lines_and_ratios_to_vllm():
    def summary(tok_s: float, cpu_ms: float) -> dict:
        return {
            "mean_tok_s": tok_s,
            "cpu_ms_per_token_all": cpu_ms,
            "busy_cores": tok_s * cpu_ms / 1e3,
        }

    results = {
        16: {
            "grpc-p-md": summary(500.0, 3.6),
            "engine": summary(600.0, 3.0),
            "vllm": summary(420.0, 4.5),
        }
    }
    lines = ceiling_table(results, cores=2)
    assert "2 cores" in lines[0]
    ours = next(line for line in lines if "grpc-p-md" in line).split()
    # CPU 3.60, busy 1.80, 500 tok/s; ceiling 1.8 / 3.6 ms = 500 tok/s, 500 / 420 = 1.19x vLLM,
    # reached 100 %; at both cores 555.6 tok/s, 1.32x vLLM.
    assert ours[2:] == ["3.60", "1.80", "500.0", "500.0", "1.19", "100%", "555.6", "1.32"]
    vllm = next(line for line in lines if line.split()[1] == "vllm").split()
    assert vllm[5] == "400.0" and vllm[6] == "0.95"  # vLLM's own ceiling at our engine's cores
    no_vllm = ceiling_table({16: {k: v for k, v in results[16].items() if k != "vllm"}}, 2)
    assert next(line for line in no_vllm if "grpc-p-md" in line).split()[6] == "-"
    unknown = ceiling_table(results, cores=0)  # no affinity to read: no bound at every core
    assert "core count unknown" in unknown[0]
    assert next(line for line in unknown if "grpc-p-md" in line).split()[-2:] == ["-", "-"]
    # Without our engine in the run there is no measured utilisation to stand on.
    assert ceiling_table({16: {"grpc-p-md": results[16]["grpc-p-md"]}}, 2) == []
