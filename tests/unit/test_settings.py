"""Flags derived from config dataclass fields: one default, one env rule, one validation."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
from dataclasses import dataclass

import pytest

from pdd.routing.policy import RoutingConfig
from pdd.server.settings import KB, MB, MS, Flag, Settings, env_name, env_names, parse_config


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Demo:
    name: str
    count: int = 3
    ratio: float = 0.5
    cache_bytes: int = 8 * 2**20
    body_bytes: int = 64 * 2**10
    hold_s: float = 0.05
    lead_s: float | None = None
    color: Color = Color.RED
    verbose: bool = False
    keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"count: must be >= 1, got {self.count}")


DEMO = Settings(
    Demo,
    "name",
    Flag("count", "how many"),
    "ratio",
    Flag("cache_bytes", unit=MB),
    Flag("body_bytes", unit=KB),
    Flag("hold_s", unit=MS),
    Flag("lead_s", unit=MS, none="auto"),
    "color",
    Flag("verbose", off="quiet"),
    Flag("keys", name="keys", aliases=("key",)),
    prefix="demo",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    DEMO.add(p, name="x")
    return p


def parse(argv: list[str]) -> Demo:
    return parse_config(parser(), argv, DEMO.build)


@pytest.fixture(autouse=True)
def _no_demo_env(monkeypatch):
    for spec in DEMO.specs:
        monkeypatch.delenv(spec.env, raising=False)


def test_defaults_are_the_dataclass_fields():
    assert parse([]) == Demo(name="x")


def test_flag_and_env_names_follow_the_one_rule():
    flags = {s.field: (s.flag, s.env) for s in DEMO.specs}
    assert flags["count"] == ("demo-count", "PDD_DEMO_COUNT")
    assert flags["cache_bytes"] == ("demo-cache-mb", "PDD_DEMO_CACHE_MB")
    assert flags["hold_s"] == ("demo-hold-ms", "PDD_DEMO_HOLD_MS")
    assert flags["keys"] == ("keys", "PDD_KEYS")
    assert env_name("tls-client-auth") == "PDD_TLS_CLIENT_AUTH"


def test_env_overrides_the_default_and_a_flag_overrides_the_env(monkeypatch):
    monkeypatch.setenv("PDD_DEMO_COUNT", "7")
    monkeypatch.setenv("PDD_DEMO_VERBOSE", "yes")
    monkeypatch.setenv("PDD_KEYS", "a, b,,c")
    assert parse([]) == Demo(name="x", count=7, verbose=True, keys=("a", "b", "c"))
    got = parse(["--demo-count", "9", "--quiet", "--key", "z"])
    assert (got.count, got.verbose, got.keys) == (9, False, ("z",))
    assert parse(["--demo-name", "y", "--no-demo-verbose"]).name == "y"


def test_units_are_converted_once_both_ways(capsys):
    got = parse(["--demo-cache-mb", "2", "--demo-body-kb", "3", "--demo-hold-ms", "20"])
    assert (got.cache_bytes, got.body_bytes, got.hold_s) == (2 * 2**20, 3 * 1024, 0.02)
    assert parse(["--demo-lead-ms", "auto"]).lead_s is None
    assert parse(["--demo-lead-ms", "5"]).lead_s == 0.005
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    # the help shows the field defaults in the flag's unit, and each env name
    assert "(env PDD_DEMO_CACHE_MB; default 8)" in out
    assert "(env PDD_DEMO_BODY_KB; default 64)" in out
    assert "(env PDD_DEMO_HOLD_MS; default 50)" in out
    assert "(env PDD_DEMO_LEAD_MS; default auto)" in out
    assert "how many (env PDD_DEMO_COUNT; default 3)" in out


def test_enums_and_choices_read_their_values(monkeypatch):
    assert parse(["--demo-color", "blue"]).color is Color.BLUE
    monkeypatch.setenv("PDD_DEMO_COLOR", "blue")
    assert parse([]).color is Color.BLUE
    choice = Settings(Demo, Flag("verbose", name="mode", choices={"loud": True, "calm": False}))
    p = argparse.ArgumentParser()
    choice.add(p)
    assert choice.values(p.parse_args(["--mode", "loud"])) == {"verbose": True}


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("PDD_DEMO_COUNT", "many"),
        ("PDD_DEMO_RATIO", "half"),
        ("PDD_DEMO_VERBOSE", "maybe"),
        ("PDD_DEMO_COLOR", "green"),
        ("PDD_DEMO_LEAD_MS", "soon"),
    ],
)
def test_a_bad_env_value_is_one_argparse_error_naming_the_variable(env, value, monkeypatch, capsys):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exit_:
        parse([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"env {env}='{value}'" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("demo: error: ")


def test_a_flag_beats_a_bad_env_value(monkeypatch):
    monkeypatch.setenv("PDD_DEMO_COUNT", "many")
    assert parse(["--demo-count", "4"]).count == 4


def test_a_bad_flag_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse(["--demo-count", "many"])
    assert "argument --demo-count: expected an integer, got 'many'" in capsys.readouterr().err


def test_a_rule_of_the_dataclass_is_one_line_naming_the_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--demo-count", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "demo: error: count: must be >= 1, got 0"


def test_a_field_without_default_is_required_unless_its_env_is_set(monkeypatch, capsys):
    p = argparse.ArgumentParser(prog="demo")
    DEMO.add(p)
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert "--demo-name" in capsys.readouterr().err
    monkeypatch.setenv("PDD_DEMO_NAME", "from-env")
    p = argparse.ArgumentParser(prog="demo")
    DEMO.add(p)
    assert DEMO.build(p.parse_args([])).name == "from-env"


def test_an_unknown_default_or_field_is_refused():
    with pytest.raises(TypeError, match="no flag for"):
        DEMO.add(argparse.ArgumentParser(), nope=1)
    with pytest.raises(TypeError, match="has no field"):
        Settings(Demo, "nope")
    with pytest.raises(TypeError, match="needs a"):
        Settings(Demo, Flag("count", unit=MB))


SERVICES = [
    "services.gateway",
    "services.kvstore",
    "services.prefill",
    "services.relay",
    "services.main_decode",
    "services.wan_link",
]


@pytest.mark.parametrize("module", SERVICES)
def test_every_service_flag_reads_the_env_name_of_its_flag(module):
    p = importlib.import_module(f"{module}.__main__").parser()
    with_env = [a for a in p._actions if hasattr(a, "env_name")]
    assert with_env, module
    for action in with_env:
        assert action.env_name == env_name(action.option_strings[0][2:]), action.option_strings
    assert len(env_names(p)) == len(with_env)  # no two flags share a variable


def test_gateway_defaults_are_its_configs_and_the_env_renames_hold(monkeypatch):
    from services.gateway.__main__ import config, parser

    for name in ("PDD_RELAY_BUSY_REQUESTS", "PDD_HIT_THRESHOLD", "PDD_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    got = config(parser().parse_args([]))
    assert got.routing == RoutingConfig()
    assert got.server.max_message_bytes == 4 * 2**20  # the gateway's own default
    monkeypatch.setenv("PDD_RELAY_BUSY_REQUESTS", "9")
    monkeypatch.setenv("PDD_API_KEYS", "k1,k2")
    got = config(parser().parse_args(["--hit-threshold", "0.5"]))
    assert dataclasses.replace(RoutingConfig(), hit_threshold=0.5, relay_busy_requests=9) == (
        got.routing
    )
    assert got.http.api_keys == ("k1", "k2")
    assert config(parser().parse_args(["--api-key", "k3"])).http.api_keys == ("k3",)
