"""Stack B against stack A in ``pdd bench served``: which contender runs where, the settings'
rules, and the round-by-round ratios (made-up rounds; the e2e smoke test runs a real stack B)."""

from __future__ import annotations

import pytest

from pdd.bench import served
from pdd.bench.served_ab import ab_table, paired_ratios
from pdd.bench.served_config import ServedConfig
from pdd.bench.served_contenders import Route, route


def test_at_b_is_the_same_contender_on_stack_b():
    assert route("grpc-p-md@b") == Route("stack-b", "grpc", "p-md")
    assert route("http-md@b") == Route("stack-b", "http", "md")
    assert route("grpc-p-md") == Route("stack", "grpc", "p-md")
    for bad in ("engine@b", "vllm@b", "grpc-p-md@b@b", "grpc-p-md@bx", "@b"):
        with pytest.raises(ValueError, match="contenders: unknown contender"):
            route(bad)


def test_b_env_rules():
    cfg = ServedConfig(contenders=("grpc-p-md", "grpc-p-md@b"), b_env=(("GOMP_SPINCOUNT", "1000"),))
    assert cfg.b_env == (("GOMP_SPINCOUNT", "1000"),)
    assert ServedConfig(contenders=("grpc-md@b",)).b_env == ()  # an A/A run
    with pytest.raises(ValueError, match="^b_env: no contender runs on stack B"):
        ServedConfig(contenders=("grpc-md",), b_env=(("X", "1"),))
    for bad in ("A-B", "1X", "", "É"):
        with pytest.raises(ValueError, match=f"^b_env: '{bad}' is not an environment variable"):
            ServedConfig(contenders=("grpc-md@b",), b_env=((bad, "1"),))
    with pytest.raises(ValueError, match="^contenders: @b names a stack contender"):
        ServedConfig(contenders=("stack-vllm@b",))
    args = served._parse(["--contenders", "grpc-md@b", "--b-env", "A=1", "--b-env", "B=x=y"])
    assert served.config_from(args).b_env == (("A", "1"), ("B", "x=y"))


def test_b_code_runs_stack_b_on_another_checkout(tmp_path):
    """``--b-code DIR``: stack B's services import that checkout (not the working directory's,
    which ``python -m`` would put first) and build its kernels apart from this one's."""
    code = tmp_path / "old"
    (code / "pdd").mkdir(parents=True)
    (code / "pdd" / "__init__.py").write_text("")
    (code / "services").mkdir()
    args = served._parse(["--contenders", "grpc-p-md,grpc-p-md@b", "--b-code", str(code)])
    env = served.config_from(args).stack_b_env()
    assert env["PYTHONSAFEPATH"] == "1" and env["PYTHONPATH"] == str(code.resolve())
    assert env["TORCH_EXTENSIONS_DIR"] != "" and "pdd-kernels-" in env["TORCH_EXTENSIONS_DIR"]
    both = ServedConfig(contenders=("grpc-md@b",), b_env=(("X", "1"),), b_code=str(code))
    assert both.stack_b_env()["X"] == "1"
    assert ServedConfig(contenders=("grpc-md@b",)).stack_b_env() == {}
    with pytest.raises(ValueError, match="^b_code: .* is not a PDD checkout"):
        ServedConfig(contenders=("grpc-md@b",), b_code=str(tmp_path))
    with pytest.raises(ValueError, match="^b_code: no contender runs on stack B"):
        ServedConfig(contenders=("grpc-md",), b_code=str(code))
    assert served.main(["--contenders", "grpc-md@b", "--b-code", str(tmp_path)]) == 2


def _round(contender: str, conc: int, wall_s: float, tokens: int = 100, **extra) -> dict:
    return {
        "contender": contender,
        "concurrency": conc,
        "wall_s": wall_s,
        "output_tokens": tokens,
        "ttft_ms": extra.get("ttft", (100.0,)),
        "tpot_ms": extra.get("tpot", (10.0,)),
    }


def test_rounds_pair_in_order_and_only_where_both_served():
    rounds = [
        _round("grpc-p-md", 16, 1.0),
        _round("grpc-p-md@b", 16, 0.8),
        _round("engine", 16, 0.5),
        _round("grpc-p-md@b", 16, 2.0),  # NOTE: round 1 of B comes before round 1 of A
        _round("grpc-p-md", 16, 1.6),
        _round("grpc-md@b", 16, 1.0),  # no grpc-md on stack A: not paired
        _round("grpc-p-md", 32, 0.0),  # a round that served nothing: no ratio
        _round("grpc-p-md@b", 32, 1.0),
    ]
    ratios = paired_ratios(rounds)
    assert set(ratios) == {(16, "grpc-p-md"), (32, "grpc-p-md")}
    assert ratios[16, "grpc-p-md"] == pytest.approx([1.25, 0.8])
    assert ratios[32, "grpc-p-md"] == []


def test_ab_table_reads_b_over_a():
    rounds = [
        _round("grpc-p-md", 16, 1.0, ttft=(200.0,), tpot=(20.0,)),
        _round("grpc-p-md@b", 16, 0.5, ttft=(100.0,), tpot=(30.0,)),
        _round("grpc-p-md", 16, 1.0, ttft=(200.0,), tpot=(20.0,)),
        _round("grpc-p-md@b", 16, 1.0, ttft=(100.0,), tpot=(30.0,)),
    ]
    title, head, row = ab_table(rounds, (("GOMP_SPINCOUNT", "1000"),))
    assert "GOMP_SPINCOUNT=1000" in title and "B/A" in head
    # A 100 tok/s both rounds; B 200 then 100: B/A 2.0 and 1.0, median 1.5
    assert row.split() == ["16", "grpc-p-md", "100.0", "150.0", "1.50", "1.00-2.00", "0.50", "1.50"]
    assert "A/A run" in ab_table(rounds, ())[0]
    assert ab_table([_round("grpc-p-md", 16, 1.0)], ()) == []
