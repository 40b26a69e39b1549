"""``pdd bench served``'s parts that need no server: prompts, CPU accounting, the table, flags,
our engine's round, py-spy's stacks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdd.bench import py_spy, served, served_contenders
from pdd.bench.record import RequestResult
from pdd.bench.served import (
    FreshPrompts,
    Round,
    ServedConfig,
    cpu_delta,
    cpu_snapshot,
    make_round,
    ratio,
    summarize,
    table,
)
from pdd.bench.served_contenders import CLIENT


def test_fresh_prompts_never_share_a_first_block():
    gen = FreshPrompts(vocab=50, length=20, seed=3)
    prompts = [p for _ in range(10) for p in gen.take(200)]  # 2000 > vocab: the counter carries
    assert all(len(p) == 20 and all(0 <= t < 50 for t in p) for p in prompts)
    # NOTE: a prefix cache can hit only a prompt whose first block it has seen; block size 2 is
    # the smallest the counter guards, so every larger block size is guarded too.
    assert len({tuple(p[:2]) for p in prompts}) == len(prompts)
    assert FreshPrompts(50, 20, seed=3).take(5) == prompts[:5]  # seeded: the same run twice
    assert FreshPrompts(50, 20, seed=4).take(5) != prompts[:5]


def test_fresh_prompts_refuse_to_wrap():
    gen = FreshPrompts(vocab=3, length=4)
    gen.take(9)
    with pytest.raises(ValueError, match="more than 9 prompts"):
        gen.take(1)
    with pytest.raises(ValueError, match="length"):
        FreshPrompts(vocab=10, length=1)


def test_cpu_delta_is_what_a_process_spent():
    before = cpu_snapshot({"me": [os.getpid()], "gone": [2**22 + 7]})
    t = time.process_time()
    while time.process_time() - t < 0.3:  # burn ~0.3 s of this process's CPU
        pass
    delta = cpu_delta(before, cpu_snapshot({"me": [os.getpid()], "gone": [2**22 + 7]}))
    assert delta["me"] == pytest.approx(0.3, abs=0.1)  # /proc's clock ticks are 10 ms
    assert delta["gone"] is None  # an unreadable process is missing, never zero
    assert cpu_delta({"a": 1.0, "b": None}, {"a": 3.5, "b": 2.0}) == {"a": 2.5, "b": None}


def test_children_of_finds_a_child_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert {os.getpid(), child.pid} <= set(served_contenders.children_of(os.getpid()))
        assert served_contenders.children_of(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()


def _round(name, wall, tokens, cpu, ttft=(10.0,), tpot=(2.0,), errors=0):
    return Round(name, 16, wall, tokens, errors, ttft, tpot, (0.5,), cpu)


def test_summary_medians_and_cpu_per_token():
    rounds = [
        _round("grpc-p-md", 2.0, 1000, {"gateway": 0.5, "main_decode-0": 3.0, CLIENT: 1.0}),
        _round("grpc-p-md", 4.0, 1000, {"gateway": 0.5, "main_decode-0": None, CLIENT: 1.0}),
        _round("grpc-p-md", 1.0, 1000, {"gateway": 1.0, "main_decode-0": 3.0, CLIENT: 1.0}),
    ]
    s = summarize(rounds)
    assert s["median_tok_s"] == 500.0 and s["best_tok_s"] == 1000.0
    assert s["cpu_ms_per_token"]["gateway"] == pytest.approx(2.0 / 3000 * 1000)
    # One round without a reading makes the process's figure unknown, not smaller.
    assert s["cpu_ms_per_token"]["main_decode-0"] is None
    # The bench's own client is shown but is no service: not in the total.
    assert s["cpu_ms_per_token"][CLIENT] == pytest.approx(1.0)
    assert s["cpu_ms_per_token_total"] == pytest.approx(2.0 / 3)
    assert s["ttft_p50_ms"] == 10.0 and s["tpot_p50_ms"] == 2.0


def test_table_ratios_to_vllm():
    results = {
        16: {
            "grpc-p-md": summarize([_round("grpc-p-md", 2.0, 1024, {"gateway": 0.1})]),
            "vllm": summarize([_round("vllm", 1.6, 1024, {"vllm-core": 2.0})]),
        }
    }
    lines = table(results)
    ours = next(line for line in lines if "grpc-p-md" in line).split()
    assert ours[2] == "512.0" and ours[4] == "0.80"  # 512 / 640 tok/s
    assert "gateway=0.10" in ours[-1]
    assert ratio(512.0, 640.0) == 0.8 and ratio(1.0, None) is None and ratio(None, 2.0) is None
    alone = table({1: {"engine": summarize([_round("engine", 1.0, 64, {"engine": 0.1})])}})
    assert alone[1].split()[4] == "-"  # no vLLM in the run: no ratio, not a made-up one


def test_make_round_counts_errors_and_the_tail():
    good = RequestResult("a", output_token_ids=[1, 2, 3], token_times_ms=[5.0, 6.0, 7.0])
    good.ttft_ms, good.e2el_ms, good.tpot_ms = 5.0, 9.0, 2.0
    short = RequestResult("b", output_token_ids=[1], token_times_ms=[5.0])
    short.e2el_ms = 6.0
    failed = RequestResult("c", error_code="UNAVAILABLE")
    r = make_round("grpc-p-md", 3, 1.0, [good, short, failed], {"gateway": 0.1}, output_len=3)
    assert r.output_tokens == 4 and r.errors == 2  # a short stream is an error too
    assert r.ttft_ms == (5.0,) and r.tail_ms == (2.0,)  # final message 2 ms after the last token


def test_engine_round_matches_generate():
    from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model

    engine = Engine(tiny_model(0, std=0.05), EngineConfig(kv_cache_bytes=16 * 2**20))
    prompts = FreshPrompts(engine.model_config.vocab_size, 12).take(3)
    cfg = ServedConfig(output_len=6, contenders=("engine",))
    recs = served_contenders.engine_round(engine, prompts, cfg, "t")
    want = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [r.output_token_ids for r in recs] == want
    assert all(r.ttft_ms <= r.e2el_ms and r.tpot_ms is not None for r in recs)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--concurrency", "0,16"], "concurrency"),
        (["--concurrency", "a"], "concurrency"),
        (["--contenders", "grpc-p-md,sglang"], "contenders"),
        (["--contenders", "vllm,vllm"], "contenders"),
        (["--output-len", "0"], "output_len"),
        (["--prompt-len", "1"], "prompt_len"),
        (["--contenders", "engine", "--model", "/nonexistent"], "model"),
        (["--contenders", "vllm", "--vllm-python", "/nonexistent/python"], "vllm_python"),
        (["--contenders", "engine@b"], "contenders"),
        (["--contenders", "grpc-md@b@b"], "contenders"),
        (["--contenders", "grpc-md", "--b-env", "X=1"], "b_env"),
        (["--contenders", "grpc-md@b", "--b-env", "NO_VALUE"], "b_env"),
        (["--contenders", "grpc-md@b", "--b-env", "=1"], "b_env"),
    ],
)
def test_bad_flags_are_one_line(argv, field, capsys):
    assert served.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pdd bench served: error: {field}")


def test_cli_routes_bench_served(capsys):
    from pdd.cli import main

    assert main(["bench", "served", "--rounds", "0"]) == 2
    assert "rounds: must be >= 1" in capsys.readouterr().err


def test_top_frames_self_and_inclusive_shares():
    raw = "\n".join(
        [
            "main (a.py:1);step (b.py:2);forward (c.py:3) 6",
            "main (a.py:1);step (b.py:2) 2",
            "main (a.py:1);send (d.py:9);step (b.py:2) 2",
            "garbage line",
        ]
    )
    top = py_spy.top_frames(raw, n=2)
    assert top[0] == ("forward (c.py:3)", 0.6, 0.6)
    # step is its own leaf in 4 of 10 samples and on the stack of all 10 (counted once each).
    assert top[1] == ("step (b.py:2)", 0.4, 1.0)
    assert py_spy.top_frames("") == []


def test_py_spy_needs_a_binary_and_a_stack(tmp_path):
    with pytest.raises(ValueError, match="py_spy: .* not an executable"):
        ServedConfig(py_spy=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="py_spy: profiles the stack"):
        ServedConfig(py_spy=sys.executable, contenders=("engine", "vllm"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_frontend_cpus_leave_the_engines_their_threads():
    n = len(os.sched_getaffinity(0))
    cfg = ServedConfig(contenders=("engine", "grpc-p-md"), frontend_cpus=1, threads=n - 1)
    assert served_contenders.Contenders(cfg, None).placement.frontend == {
        max(os.sched_getaffinity(0))
    }
    with pytest.raises(ValueError, match=rf"^threads: must be <= the {n - 1} CPUs"):
        ServedConfig(contenders=("engine",), frontend_cpus=1, threads=n)
    with pytest.raises(ValueError, match="^frontend_cpus: must be 1"):
        ServedConfig(contenders=("engine",), frontend_cpus=n, threads=1)
    assert (
        served.config_from(
            served._parse(["--frontend-cpus", "1", "--threads", "1", "--contenders", "engine"])
        ).frontend_cpus
        == 1
    )
