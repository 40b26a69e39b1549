"""Every ``pdd`` subcommand, given a mistake, ends in one line on stderr and a non-zero exit.

Missing files, files in the wrong format, unreachable gateways, bad flag values and a model
path that does not exist: no Python traceback, and nothing starts (no model is loaded, no
process is launched). Most cases run ``pdd.cli.main`` in process; a few run the installed
``pdd`` as a subprocess, as a user would, and ``--debug`` brings the traceback back.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from pdd.cli import main
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from tests.conftest import ROOT

PDD = Path(sys.executable).with_name("pdd")
MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
    {"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 3]},
]
GOOD = {"request_id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")

    def jsonl(name: str, *lines: object) -> Path:
        path = d / name
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
        return path

    return {
        "dir": d,
        "mooncake": jsonl("mooncake.jsonl", *MOONCAKE_ROWS),
        "no_max_tokens": jsonl("no_max.jsonl", GOOD, {"request_id": "b", "prompt_token_ids": [1]}),
        "not_json": jsonl("not_json.jsonl", GOOD, "{oops"),
        "not_object": jsonl("list.jsonl", [1, 2]),
        "bad_token": jsonl("bad_token.jsonl", GOOD, {**GOOD, "prompt_token_ids": [1, "x"]}),
        "empty": jsonl("empty.jsonl"),
        "bad_hash_ids": jsonl(
            "bad_hash.jsonl", MOONCAKE_ROWS[0], {**MOONCAKE_ROWS[1], "hash_ids": "12"}
        ),
        "ours": jsonl("ours.jsonl", GOOD),
        "not_result": jsonl("not_result.json", {"foo": 1}),
    }


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


# (the command line after `pdd`, with {name} placeholders for `files`; what its error line says)
BENCH = "bench --mode pdd --out {dir}/o.json --trace"
CASES = [
    # pdd bench [run]
    (f"{BENCH} {{dir}}/missing.jsonl", "missing.jsonl: No such file or directory"),
    (f"{BENCH} {{no_max_tokens}}", "no_max.jsonl:2: max_tokens: missing"),
    (f"{BENCH} {{not_json}}", "not_json.jsonl:2: not a JSON line"),
    (f"{BENCH} {{not_object}}", "list.jsonl:1: expected a JSON object"),
    (f"{BENCH} {{bad_token}}", "bad_token.jsonl:2: prompt_token_ids: expected an integer, got 'x'"),
    (f"{BENCH} {{empty}}", "empty.jsonl: no requests"),
    (f"{BENCH} {{bad_hash_ids}}", "bad_hash.jsonl:2: hash_ids: expected a list of integers"),
    (f"{BENCH} {{ours}} --model /no/such", "model: /no/such: no such file or directory"),
    ("bench run --trace {ours} --mode pd --out {dir}/o.json", "argument --mode: invalid choice"),
    (f"{BENCH} {{ours}} --rps -1", "rps: must be > 0"),
    (f"{BENCH} {{ours}} --slo nonsense", "slo: unknown metric 'nonsense'"),
    (
        f"{BENCH} {{ours}} --gateway 127.0.0.1:{{closed}}",
        "gateway 127.0.0.1:{closed}: UNAVAILABLE: cannot connect",
    ),
    (f"{BENCH} {{ours}} --gateway 127.0.0.1:1 --connect-timeout 0", "--connect-timeout"),
    ("bench nosuch", "unknown command 'nosuch'"),
    # pdd bench compare / sim / link / engine
    ("bench compare {dir}/missing.json", "No such file or directory"),
    ("bench compare {not_result}", "not_result.json: not a RESULT file"),
    ("bench compare {not_json}", "not_json.jsonl: not a RESULT file (line 2"),
    ("bench sim --rps -1", "rps: must be >= 0"),
    ("bench sim --modes bogus", "--modes: choose from idc-pd, cdc-pd, pdd"),
    ("bench sim --json {dir}/no/such/sim.json", "--json: no folder"),
    ("bench link --mbps -1", "mbps"),
    ("bench link --sizes-mb abc", "invalid literal"),
    ("bench engine --threads 0", "set_num_threads"),
    # pdd trace gen / mooncake
    ("trace gen --sessions 0 --out {dir}/t.jsonl", "sessions: must be >= 1"),
    ("trace gen --turns 1 --out {dir}/no/such/t.jsonl", "t.jsonl: No such file or directory"),
    ("trace mooncake {dir}/missing.jsonl --out {dir}/t.jsonl", "missing.jsonl: No such file"),
    ("trace mooncake {not_json} --out {dir}/t.jsonl", "not_json.jsonl:1: timestamp: missing (this"),
    ("trace mooncake {bad_hash_ids} --out {dir}/t.jsonl", "bad_hash.jsonl:2: hash_ids"),
    ("trace mooncake {mooncake} --out {dir}/t.jsonl --block-tokens 0", "block_tokens: must be >="),
    ("trace nosuch", "unknown command 'nosuch'"),
    # pdd up: refused before anything starts
    ("up --log-dir {dir}/up-logs --model /no/such/m.gguf", "model: /no/such/m.gguf: no such file"),
    ("up --log-dir {dir}/up-logs --model tiny:x", "model: malformed tiny spec"),
    ("up --log-dir {dir}/up-logs --model {dir}", "has no config.json"),
    ("up --log-dir {dir}/up-logs --prefill 0", "prefill: too few instances"),
    ("up --log-dir {dir}/up-logs --gateway-port 70000", "gateway_port: must be in 0..65535"),
    ("up --log-dir {dir}/up-logs --redis-url localhost:6379", "redis_url: expected redis://"),
    ("up --log-dir {dir}/up-logs --wan-mbps -1", "mbps: must be >= 0"),
    ("up --prefill many", "argument --prefill: invalid int value"),
    # pdd generate
    ("generate hi --gateway 127.0.0.1:{closed}", "cannot connect"),
    ("generate hi --max-tokens abc", "argument --max-tokens: invalid int value"),
    ("generate hi --connect-timeout 0", "--connect-timeout: must be > 0"),
    ("generate hi --tls-ca {dir}/no-ca.pem --gateway 127.0.0.1:{closed}", "no-ca.pem"),
    # pdd demo: refused before a trace is made or a stack started
    ("demo --out {dir}/demo --model /no/such/dir", "model: /no/such/dir"),
    ("demo --out {dir}/demo --modes pdd,bogus", "mode: must be one of"),
    ("demo --out {dir}/demo --sessions 0", "sessions: must be >= 1"),
    ("demo --preset huge", "argument --preset: invalid choice"),
    # pdd itself
    ("nosuch", "invalid choice: 'nosuch'"),
]


@pytest.mark.parametrize(
    "line,expected", CASES, ids=[f"{i}-{' '.join(c.split()[:2])}" for i, (c, _) in enumerate(CASES)]
)
def test_a_mistake_ends_in_one_error_line(line, expected, files, capsys):
    names = {k: str(v) for k, v in files.items()} | {"closed": str(_closed_port())}
    argv = shlex.split(line.format(**names))
    expected = expected.format(**names)
    t0 = time.monotonic()
    code, err = run_main(argv, capsys)
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("pdd") and ": error: " in last, err
    assert expected in last, err
    # NOTE: nothing was started or loaded: every mistake is found in well under the time a
    # stack or a model takes (an unreachable gateway within its 3 s connect deadline).
    assert time.monotonic() - t0 < 8, f"took {time.monotonic() - t0:.1f} s"
    assert not (files["dir"] / "up-logs").exists(), "pdd up started something"
    assert not (files["dir"] / "demo").exists(), "pdd demo started something"


def test_errors_after_usage_are_one_line_alone(files, capsys):
    """A runtime error (not a usage mistake) is the whole of stderr: one line, no usage text."""
    code, err = run_main(["trace", "mooncake", str(files["ours"]), "--out", "x.jsonl"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err


class _ModelInfoOnly(pb_grpc.GatewayServiceServicer):
    """A gateway that says its vocabulary and serves nothing (Generate: UNIMPLEMENTED)."""

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model="fake", vocab_size=512, max_context_tokens=4096)


def test_bench_recognises_a_mooncake_trace_and_fits_it_to_the_served_vocabulary(files, capsys):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GatewayServiceServicer_to_server(_ModelInfoOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        argv = ["bench", "--trace", str(files["mooncake"]), "--mode", "pdd", "--quiet"]
        code, err = run_main(
            [*argv, "--out", str(files["dir"] / "o.json"), "--gateway", f"127.0.0.1:{port}"],
            capsys,
        )
    finally:
        server.stop(0)
    lines = err.strip().splitlines()
    # Read as Mooncake, its ids drawn below the served vocabulary (so the vocabulary check
    # passed), then the warm-up's failure, in one line.
    assert "a Mooncake trace" in lines[0] and "token ids in [100, 512)" in lines[0], err
    assert code == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("pdd bench run: error: warm-up request") and "UNIMPLEMENTED" in err


def _pdd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    assert PDD.exists(), f"{PDD}: the pdd entry point is not installed (make venv)"
    return subprocess.run(
        [str(PDD), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_subprocess_unreachable_gateway_fails_fast_in_one_line():
    t0 = time.monotonic()
    out = _pdd("generate", "hi", "--gateway", f"127.0.0.1:{_closed_port()}")
    assert time.monotonic() - t0 < 10
    assert out.returncode == 1, out
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("pdd generate: error: gateway")


def test_subprocess_missing_model_is_refused_before_anything_starts(tmp_path):
    out = _pdd("up", "--model", str(tmp_path / "nope.gguf"), "--log-dir", str(tmp_path / "logs"))
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.startswith("pdd up: error: model: ") and out.stderr.count("\n") == 1
    assert not (tmp_path / "logs").exists()


def test_subprocess_bad_trace_names_file_line_and_field(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "max_tokens": 0}) + "\n")
    out = _pdd("bench", "--trace", str(bad), "--mode", "pdd", "--out", str(tmp_path / "o.json"))
    assert out.returncode == 1, out
    assert out.stderr == f"pdd bench run: error: {bad}:2: max_tokens: must be >= 1, got 0\n"


def test_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    debug = _pdd("--debug", "trace", "mooncake", missing, "--out", "x.jsonl")
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


@pytest.mark.parametrize("where", ["first", "last"])
def test_debug_anywhere_before_a_double_dash_lets_the_exception_out(where, tmp_path):
    argv = ["trace", "mooncake", str(tmp_path / "missing.jsonl"), "--out", "x.jsonl"]
    with pytest.raises(FileNotFoundError):
        main(["--debug", *argv] if where == "first" else [*argv, "--debug"])


def test_version():
    out = _pdd("--version")
    assert out.returncode == 0 and out.stdout.startswith("pdd ")
    from importlib.metadata import version

    assert out.stdout.split()[1] == version("pdd")


def test_a_gateway_that_accepts_but_never_answers_fails_at_the_connect_deadline():
    from pdd.bench.runner import wait_for_gateway
    from pdd.core.errors import UnavailableError

    with socket.socket() as s:  # TCP completes in the kernel's backlog; HTTP/2 never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="not reachable within 0.5 s"):
            asyncio.run(wait_for_gateway(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=0.5))
        assert time.monotonic() - t0 < 3
