"""``pdd bench gateway``'s pure parts: its config, the token check, the window's figures."""

from __future__ import annotations

import pytest

from pdd.bench.gateway_bench import GatewayBenchConfig, Window, check_tokens, main, table
from pdd.testbed.flood_tokens import token_at


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("concurrency", 0, "concurrency"),
        ("output_len", 0, "output_len"),
        ("seconds", 0.0, "seconds"),
        ("tokens_per_message", (1, 0), "tokens_per_message"),
        ("tokens_per_message", (), "tokens_per_message"),
        ("doors", ("grpc", "smtp"), "doors"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(field, value, names):
    with pytest.raises(ValueError, match=names):
        GatewayBenchConfig(**{field: value})


def test_the_token_check_knows_the_floods_tokens():
    ids = [token_at(p, 256) for p in range(5, 9)]
    assert check_tokens(5, ids, 256) is None
    assert "tokens at 6" in check_tokens(6, ids, 256)  # shifted by one position
    assert check_tokens(5, [*ids[:-1], ids[-1] + 1], 256) is not None


def test_a_window_turns_cpu_time_into_tokens_per_core_second():
    w = Window("grpc", 1, tokens=20_000, wall_s=2.0, gateway_cpu_s=0.5)
    assert w.cpu_us_per_token == pytest.approx(25.0)
    assert w.tokens_per_core_s == pytest.approx(40_000)
    assert w.busy == pytest.approx(0.25)
    row = table([w])[-1].split()
    assert row[:4] == ["grpc", "shared", "1", "20000"] and row[-2:] == ["0.80", "0"]  # 0.8 x 50k
    assert Window("http", 4).tokens_per_core_s is None  # nothing measured: no figure


def test_a_bad_flag_ends_in_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--tokens-per-message", "1,x"])
    assert exit_.value.code == 2 and "--tokens-per-message" in capsys.readouterr().err
