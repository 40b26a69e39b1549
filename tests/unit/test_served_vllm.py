"""``pdd bench served``'s PDD-on-vLLM parts that need no vLLM: which contender is served by what,
the helper's flags, a helper that fails to start, and the overhead table against ``vllm serve``."""

from __future__ import annotations

import os
import sys
import time

import pytest

from pdd.bench import served, served_vllm
from pdd.bench.served import ServedConfig, summarize
from pdd.bench.served_contenders import Route, route
from pdd.bench.served_overhead import (
    emulator_share,
    emulator_table,
    heaviest,
    overhead,
    overhead_table,
)
from pdd.bench.served_vllm import VllmStack, VllmStackConfig


def test_every_contender_has_a_route():
    assert route("stack-vllm") == Route("stack-vllm", "grpc", "p-md")
    assert route("stack-vllm-http") == Route("stack-vllm", "http", "p-md")
    assert route("grpc-p-rld-md") == Route("stack", "grpc", "p-rld-md")
    assert route("http-md") == Route("stack", "http", "md")
    assert route("http-p-md") == Route("stack", "http", "p-md")
    assert route("vllm") == Route("vllm", "http")
    assert route("engine").server == "engine"
    assert {route(c).server for c in served.CONTENDERS} == {"stack", "stack-vllm", "engine", "vllm"}
    with pytest.raises(ValueError, match="contenders: unknown contender 'sglang'"):
        route("sglang")


def test_the_stack_on_vllm_is_chosen_by_name_only(tmp_path):
    assert not set(ServedConfig().contenders) & set(served_vllm.VLLM_STACK_CONTENDERS)
    args = served._parse(["--contenders", "stack-vllm,vllm", "--vllm-python", sys.executable])
    assert served.config_from(args).contenders == ("stack-vllm", "vllm")
    # It runs its services on the vLLM venv's Python: that one must exist, even without `vllm`.
    with pytest.raises(ValueError, match="vllm_python: .* not an executable"):
        ServedConfig(contenders=("stack-vllm-http",), vllm_python=str(tmp_path / "python"))


def test_bad_stack_vllm_flags_are_one_line(capsys):
    argv = ["--contenders", "stack-vllm", "--vllm-python", "/nonexistent/python"]
    assert served.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pdd bench served: error: vllm_python")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdd.engine import tiny_model

    return tiny_model(0, std=0.05).save_hf(tmp_path_factory.mktemp("m") / "model")


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(model="/nonexistent"), "model"),
        (dict(python="/nonexistent/python"), "python"),
        (dict(threads=0), "threads"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(startup_s=0.0), "startup_s"),
    ],
)
def test_vllm_stack_config_names_the_bad_field(model_dir, tmp_path, change, field):
    base = dict(model=str(model_dir), python=sys.executable, log_dir=tmp_path)
    with pytest.raises(ValueError, match=f"^{field}: "):
        VllmStackConfig(**(base | change))


def test_the_helper_starts_the_stack_it_is_told(model_dir, tmp_path):
    cfg = VllmStackConfig(str(model_dir), sys.executable, tmp_path, threads=1, max_num_seqs=16)
    argv = cfg.helper_argv(tmp_path / "ready.json")
    assert argv[:3] == [sys.executable, "-m", "pdd.bench.served_vllm"]
    stack = served_vllm._stack_config(served_vllm._parse(argv[3:]))
    flags = stack.engine_flags
    assert flags[flags.index("--engine") + 1] == "vllm"
    assert flags[flags.index("--threads") + 1] == "1"
    assert flags[flags.index("--max-num-seqs") + 1] == "16"
    # P-MD only: no relay (a third vLLM start for nothing); HTTP on for stack-vllm-http.
    assert stack.relay == 0 and stack.http_port > 0 and stack.model == str(model_dir)


def test_a_helper_that_dies_is_a_clear_error(model_dir, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no vllm here' >&2\nexit 3\n")
    fake.chmod(0o755)
    cfg = VllmStackConfig(str(model_dir), str(fake), tmp_path / "logs", startup_s=600.0)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="the vLLM stack did not start; see .*helper.log"):
        VllmStack(cfg)
    assert time.monotonic() - t < 300  # found dead, not waited out (its deadline is 20 min)
    assert "no vllm here" in (tmp_path / "logs" / "helper.log").read_text()


def test_vllm_env_keeps_the_callers_settings(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = served_vllm.vllm_env(threads=2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "7" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["OMP_NUM_THREADS"] == "2"  # or vLLM cuts a PDD service's torch to 1 thread
    assert env["PATH"] == os.environ["PATH"]


def _summary(tok_s, ttft, tpot, cpu):
    wall = 2048 / tok_s
    r = served.Round("x", 16, wall, 2048, 0, (ttft,), (tpot,), (0.5,), cpu)
    return summarize([r])


def test_overhead_is_each_figure_over_vllm_serve():
    vllm = _summary(400.0, 100.0, 20.0, {"vllm-api": 0.4, "vllm-core": 3.6})
    stack = _summary(300.0, 150.0, 25.0, {"gateway": 1.0, "main_decode-0": 4.0, "prefill-0": 1.0})
    r = overhead(stack, vllm)
    assert r["median_tok_s"] == pytest.approx(0.75) and r["ttft_p50_ms"] == pytest.approx(1.5)
    assert r["tpot_p50_ms"] == pytest.approx(1.25) and r["cpu_ms_per_token_total"] == 1.5
    assert overhead(stack, {"median_tok_s": 0.0})["median_tok_s"] is None  # never a made-up one
    top = heaviest({"a": 1.0, "b": None, "c": 3.0, "d": 2.0, "e": 0.5})
    assert top == [("c", 3.0), ("d", 2.0), ("a", 1.0)]

    stack["same_outputs_as"] = "vllm 16/16"
    lines = overhead_table({16: {"stack-vllm": stack, "vllm": vllm}})
    row = next(line for line in lines if "stack-vllm" in line).split()
    assert row[:6] == ["16", "stack-vllm", "0.75", "1.50", "1.25", "1.50"]
    assert row[6:8] == ["vllm", "16/16"] and row[8].startswith("main_decode-0=")
    assert not any(line.split()[1:2] == ["vllm"] for line in lines[2:])  # not over itself
    assert overhead_table({16: {"stack-vllm": stack}}) == []  # no vLLM in the run: no table


def test_the_emulators_part_of_the_stacks_cpu_is_said():
    per = {"main_decode-0": 1.2, "prefill-0": 0.5, "wan-0": 0.1, "wan-east": 0.1, "gateway": 0.1}
    stack = {"cpu_ms_per_token": per, "cpu_ms_per_token_total": 2.0}
    engine = {"cpu_ms_per_token": {"engine": 1.5}, "cpu_ms_per_token_total": 1.5}
    share = emulator_share(stack, engine)
    assert share is not None
    assert share["ms_per_token"] == pytest.approx(0.2)  # every link's process counts
    assert share["of_stack"] == pytest.approx(0.1)
    assert share["of_gap_to_engine"] == pytest.approx(0.4)  # 0.2 of the 0.5 beyond the engine
    assert emulator_share(stack, None)["of_gap_to_engine"] is None  # type: ignore[index]
    assert emulator_share(engine, engine) is None  # no emulator: no line
    lines = emulator_table({16: {"grpc-p-md": stack, "engine": engine, "vllm": {}}})
    assert lines[0].startswith("the WAN emulator") and len(lines) == 3
    assert lines[2].split() == ["16", "grpc-p-md", "0.200", "10.0%", "40.0%"]
    assert emulator_table({16: {"engine": engine}}) == []


def test_vllm_serve_flags_reach_its_command_line(tmp_path):
    argv = ["--vllm-serve-flag=--distributed-executor-backend=uni", "--concurrency", "16,96"]
    cfg = served.config_from(served._parse([*argv, "--vllm-python", sys.executable]))
    line = served_vllm.serve_argv(cfg, tmp_path, 8123)
    assert line[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert line[-1] == "--distributed-executor-backend=uni"  # after the bench's own flags
    assert line[line.index("--max-num-seqs") + 1] == "96"
    assert line[line.index("--max-model-len") + 1] == str(cfg.prompt_len + cfg.output_len + 16)
    assert line[line.index("--port") + 1] == "8123"
