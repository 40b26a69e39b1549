"""docker-compose.yml and the Dockerfile, checked offline (no Docker engine here or in CI).

``docker-compose config -q`` validates the file; the rest reads it as data: every PDD service
runs an entry point that ``pdd up`` (``pdd.testbed.stack``) starts, main-decode sits only on the
``remote`` network behind the WAN emulators, every hop is TLS with the certificates
``make certs`` writes, and every ``PDD_*`` name is one the code reads.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from pdd.server.settings import env_names
from pdd.testbed import stack as stack_module
from pdd.testbed.launcher import Process
from pdd.tools import certs
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
# The example environment file the README's `docker compose --env-file ... up` line names.
ENV_EXAMPLE = ROOT / "deploy" / "compose.env.example"
WAN_LINKS = {"wan-link", "wan-link-kvstore"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def pdd_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if name != "redis"}


def env_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    return {k: str(v) for k, v in env.items()}


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates():
    cli = _compose_cli()
    if cli is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed (make tools installs it)")
        pytest.skip("docker-compose is not installed; `make tools` installs it")
    env = {**os.environ, "PDD_API_KEYS": "test-key"}
    out = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # API keys are on: without PDD_API_KEYS the file does not even validate.
    env.pop("PDD_API_KEYS")
    out = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "PDD_API_KEYS" in out.stderr, out.stdout + out.stderr


def _env_file(path: Path) -> dict[str, str]:
    """A compose env file's set variables (``KEY=VALUE`` lines; ``#`` lines are comments)."""
    pairs = (
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    return {k.strip(): v.strip() for k, v in pairs}


def test_the_example_env_file_makes_config_pass():
    cli = _compose_cli()
    if cli is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed (make tools installs it)")
        pytest.skip("docker-compose is not installed; `make tools` installs it")
    example = _env_file(ENV_EXAMPLE)
    assert example.get("PDD_API_KEYS"), "the example must set the one required variable"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    out = subprocess.run(
        [*cli, "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    gateway = yaml.safe_load(out.stdout)["services"]["gateway"]
    assert env_of(gateway)["PDD_API_KEYS"] == example["PDD_API_KEYS"]


def test_the_example_env_file_names_every_variable_compose_reads(compose):
    text = ENV_EXAMPLE.read_text()
    used = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    assert used, "no ${VAR} found in docker-compose.yml"
    undocumented = sorted(v for v in used if not re.search(rf"^#? ?{v}=", text, re.MULTILINE))
    assert not undocumented, f"{ENV_EXAMPLE.name} does not mention {undocumented}"
    # The README's compose line uses this very file.
    readme = (ROOT / "README.md").read_text()
    assert f"--env-file {ENV_EXAMPLE.relative_to(ROOT)}" in readme


class _FakeProc:
    returncode = 0

    def poll(self) -> int:
        return 0


def modules_pdd_up_starts(tmp_path, monkeypatch) -> dict[str, set[str]]:
    """What ``Stack.start`` (``pdd up``) runs: module → the flags it passes, without starting anything."""
    started: dict[str, set[str]] = {}

    def fake_start(name, module, args, **_):
        started.setdefault(module, set()).update(a for a in args if a.startswith("--"))
        return Process(name, _FakeProc(), "127.0.0.1:1")

    monkeypatch.setattr(stack_module, "start_module", fake_start)
    stack_module.Stack(
        stack_module.StackConfig(
            model="tiny:7", redis_url="redis://127.0.0.1:1/0", log_dir=tmp_path
        )
    ).start()
    return started


def test_every_service_runs_an_entry_point_pdd_up_starts(compose, tmp_path, monkeypatch):
    expected = modules_pdd_up_starts(tmp_path, monkeypatch)
    commands = {name: svc["command"] for name, svc in pdd_services(compose).items()}
    for name, command in commands.items():
        assert command[:2] == ["python", "-m"], f"{name}: {command}"
    modules = {command[2] for command in commands.values()}
    assert modules == set(expected), (
        f"compose runs {sorted(modules)}, pdd up starts {sorted(expected)}"
    )
    for name, command in commands.items():
        flags = service_parser(command[2])._option_string_actions
        for flag in (a for a in command[3:] if a.startswith("--")):
            assert flag in flags, f"{name}: {command[2]} has no flag {flag}"


def test_main_decode_sits_behind_the_wan(compose):
    services, nets = compose["services"], compose["networks"]
    assert set(nets) == {"main", "remote"} and nets["remote"].get("internal") is True
    assert services["main-decode"]["networks"] == ["remote"]
    for name in WAN_LINKS:
        assert set(services[name]["networks"]) == {"main", "remote"}
    for name in set(services) - WAN_LINKS - {"main-decode"}:
        assert services[name]["networks"] == ["main"], name
    md = env_of(services["main-decode"])

    def upstream(link: str) -> str:
        command = services[link]["command"]
        return command[command.index("--upstream") + 1]

    # The main cluster dials main-decode at the link's address; the link forwards to main-decode.
    assert md["PDD_ADVERTISE_ADDRESS"] == f"wan-link:{md['PDD_PORT']}"
    assert upstream("wan-link") == f"main-decode:{md['PDD_PORT']}"
    # main-decode's own calls to kvstore cross the WAN too.
    assert md["PDD_KVSTORE"] == "wan-link-kvstore:50051"
    assert upstream("wan-link-kvstore") == f"kvstore:{env_of(services['kvstore'])['PDD_PORT']}"
    assert md["PDD_CLUSTER"] == "remote"


def test_every_hop_is_tls_with_make_certs_files(compose):
    for name, svc in pdd_services(compose).items():
        assert "./certs:/certs:ro" in svc["volumes"], name
        if name in WAN_LINKS:
            continue  # a TCP proxy: TLS passes through it
        env = env_of(svc)
        assert env["PDD_TLS_CA"] == "/certs/ca.crt"
        assert (
            env["PDD_TLS_CERT"] == f"/certs/{name}.crt"
            and env["PDD_TLS_KEY"] == f"/certs/{name}.key"
        )
        assert name in certs.SERVICES, f"make certs writes no certificate for {name}"
        # Internal services demand client certificates; the public gateway does not.
        assert env["PDD_TLS_CLIENT_AUTH"] == ("false" if name == "gateway" else "true"), name
    # The names peers dial across the WAN are on the certificates behind the links.
    assert "wan-link" in certs.SERVICES["main-decode"]
    assert "wan-link-kvstore" in certs.SERVICES["kvstore"]


def test_health_checks_speak_grpc_health_on_each_services_port(compose):
    for name, svc in pdd_services(compose).items():
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "pdd.tools.health_probe"], name
        if name in WAN_LINKS:
            listen = svc["command"][svc["command"].index("--listen") + 1]
            assert test[4] == f"127.0.0.1:{listen.rpartition(':')[2]}"
            assert "--tls-cert" in test  # probes the service behind the link, under its mTLS
        else:
            assert test[4] == f"127.0.0.1:{env_of(svc)['PDD_PORT']}", name
    assert compose["services"]["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_gateway_publishes_grpc_and_http_with_api_keys_on(compose):
    gw = compose["services"]["gateway"]
    env = env_of(gw)
    assert env["PDD_API_KEYS"].startswith("${PDD_API_KEYS:?")
    assert env["PDD_HTTP_PORT"] == "8000"
    targets = {p.rpartition(":")[2] for p in gw["ports"]}
    assert targets == {env["PDD_PORT"], env["PDD_HTTP_PORT"]}
    assert all("ports" not in svc for name, svc in compose["services"].items() if name != "gateway")


def service_parser(module: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>`` (flags and env names derive from configs)."""
    return importlib.import_module(f"{module}.__main__").parser()


def _code_text() -> str:
    return "\n".join(
        p.read_text()
        for folder in ("pdd", "services")
        for p in (ROOT / folder).rglob("*.py")
        if "gen" not in p.relative_to(ROOT).parts
    )


def test_every_pdd_env_name_is_read_by_the_code(compose):
    code = _code_text()
    names = {
        k
        for svc in compose["services"].values()
        for k in (svc.get("environment") or {})
        if k.startswith("PDD_")
    }
    assert names, "no PDD_* settings found"
    # NOTE: a service's flags derive their env names (pdd.server.settings): ask its parser.
    read = set().union(
        *(env_names(service_parser(svc["command"][2])) for svc in pdd_services(compose).values())
    )
    unknown = sorted(n for n in names if n not in read and f'"{n}"' not in code)
    assert not unknown, f"no code reads {unknown}"


def test_dockerfile_builds_the_project_with_the_pinned_cpu_torch():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    pin = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    )
    assert f"ARG TORCH_VERSION={pin.split('==')[1]}" in text
    assert "download.pytorch.org/whl/cpu" in text
    copied = re.findall(r"^COPY (\S+)", text, re.MULTILINE)
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in copied:
        assert (ROOT / path).exists(), f"Dockerfile copies {path}, which does not exist"
        assert path not in ignored, f".dockerignore drops {path}, which the Dockerfile copies"
    for secret in (".venv", ".git", "certs"):
        assert secret in ignored
    assert re.search(r'^CMD \["python", "-m", "services\.\w+"\]', text, re.MULTILINE)
    assert re.search(r"^USER \d+", text, re.MULTILINE), "the services should not run as root"
