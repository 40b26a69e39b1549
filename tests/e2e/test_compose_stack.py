"""docker-compose.yml for real: the image built, every container run, a MainDecode killed.

The life of the module (its fixtures in order; each phase's seconds in ``build/docker/timings.json``):

1. ``daemon``: a private ``dockerd`` (``pdd.testbed.docker_daemon``: no NAT rules, no docker0,
   its own folders) whose data root ``build/docker/data`` (git-ignored) keeps images and
   layers between runs. Stopped at the end, pass or fail, with every container it ran.
2. ``image``: what ``make image`` does: the base from debootstrap (a cached tarball after the
   first time), then the Dockerfile with ``BASE_IMAGE`` set to it; a code change rebuilds only
   the last layers.
3. ``stack``: certificates as ``make certs`` writes them, in a temporary project directory;
   ``docker-compose up`` with the API key of ``deploy/compose.env.example``, the gateway
   published on free ports of 127.0.0.1; every container healthy; ``down`` at the end.
4. The tests: greedy requests through gRPC and the OpenAI API equal an in-process engine's
   tokens; one request's id is in the log of every container on its path; the MainDecode
   serving a request is SIGKILLed mid-stream and the gateway moves the request to the other
   one, the client's tokens unchanged; the Kubernetes manifests' commands run in the image.

Traffic: the host talks to the stack only through the ports published on 127.0.0.1; the
containers talk on their compose networks (``remote`` is internal) and, with no NAT, reach
nothing else. Only the build uses the host's network (``--network host``: package registries).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from pdd.client import generate_stream
from pdd.core.errors import UnavailableError
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.server.tls import TlsConfig
from pdd.serving.model_spec import load_model
from pdd.testbed.docker_daemon import DockerDaemon
from pdd.testbed.docker_image import CACHE, ImageConfig, build_image, daemon_config
from pdd.testbed.launcher import free_port
from pdd.tools import certs
from tests.conftest import ROOT
from tests.unit.test_deploy_compose import COMPOSE, ENV_EXAMPLE, _env_file, make_certs_sans

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAIN_DECODES = ("main-decode", "main-decode-1")
# The containers a P-RLD-MD request passes through (besides one of MAIN_DECODES).
PATH_SERVICES = ("gateway", "kvstore", "prefill", "relay")
HEALTH_TIMEOUT_S = 420
TIMINGS: dict[str, float] = {}


def _require() -> None:
    missing = [t for t in ("dockerd", "debootstrap", "docker-compose") if shutil.which(t) is None]
    why = f"{', '.join(missing)} not installed (.ci/run / make docker-deps)" if missing else ""
    if not why and os.geteuid() != 0:
        why = "a private dockerd runs as root"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def daemon():
    _require()
    start = time.monotonic()
    try:
        # NOTE: `make test` builds the image in the background meanwhile: wait for it to end
        d = DockerDaemon(daemon_config(lock_wait_s=1800)).start()
    except UnavailableError as exc:
        pytest.fail(str(exc))
    try:
        # NOTE: a run killed before its `down` leaves containers in the cached data root.
        if stale := d.run("ps", "-aq").stdout.split():
            d.run("rm", "-f", *stale)
        d.run("network", "prune", "-f")
        TIMINGS["daemon_start"] = time.monotonic() - start
        yield d
    finally:
        assert d.stop() is not None
        CACHE.mkdir(parents=True, exist_ok=True)
        (CACHE / "timings.json").write_text(json.dumps(TIMINGS, indent=1) + "\n")
        print("compose_timings", {k: round(v, 1) for k, v in TIMINGS.items()})


@pytest.fixture(scope="module")
def image(daemon) -> str:
    config = ImageConfig()
    start = time.monotonic()
    try:
        times = build_image(daemon, config)
    except UnavailableError as exc:
        pytest.fail(str(exc))
    TIMINGS.update({f"image_{k}": v for k, v in times.items()})
    TIMINGS["image_total"] = time.monotonic() - start
    # Keep the cache to the layers in use: a rebuilt tag leaves its old ones dangling.
    daemon.run("image", "prune", "-f", timeout=300)
    return config.tag


class ComposeStack:
    """One compose project in ``daemon``: its containers by service, their logs, the endpoints."""

    def __init__(self, daemon: DockerDaemon, project: str, folder: Path, ports: dict[str, int]):
        self.daemon, self.project, self.folder = daemon, project, folder
        self.grpc = f"127.0.0.1:{ports['PDD_GRPC_PUBLISH']}"
        self.http = f"https://127.0.0.1:{ports['PDD_HTTP_PUBLISH']}"
        self.tls = TlsConfig(ca=str(folder / "certs" / "ca.crt"))
        self.env = {
            **{k: v for k, v in daemon.env().items() if not k.startswith("PDD_")},
            **{k: str(v) for k, v in ports.items()},
        }

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        command = ["docker-compose", "--project-name", self.project]
        command += ["--project-directory", str(self.folder), "-f", str(COMPOSE)]
        command += ["--env-file", str(ENV_EXAMPLE), *args]
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def containers(self) -> dict[str, str]:
        """service → container id."""
        out = self.daemon.run(
            "ps",
            "-a",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--format",
            '{{.ID}} {{.Label "com.docker.compose.service"}}',
        ).stdout
        return {svc: cid for cid, svc in (line.split() for line in out.splitlines())}

    def inspect(self, service: str, template: str) -> str:
        cid = self.containers()[service]
        return self.daemon.run("inspect", "--format", template, cid).stdout.strip()

    def log_lines(self, service: str) -> list[dict]:
        # NOTE: the services log to stderr (structlog), their PDD_LISTENING lines go to stdout.
        out = self.daemon.run("logs", self.containers()[service])
        lines = (out.stdout + out.stderr).splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def lines_of(self, service: str, request_id: str) -> list[dict]:
        return [d for d in self.log_lines(service) if d.get("request_id") == request_id]

    def wait_healthy(self, timeout: float) -> None:
        expected = set(yaml.safe_load(COMPOSE.read_text())["services"])
        deadline = time.monotonic() + timeout
        state: dict[str, str] = {}
        while time.monotonic() < deadline:
            state = {
                svc: self.inspect(svc, "{{.State.Status}}/{{.State.Health.Status}}")
                for svc in self.containers()
            }
            if set(state) == expected and all(s == "running/healthy" for s in state.values()):
                return
            if any(
                s.startswith(("exited", "dead")) or s.endswith("unhealthy") for s in state.values()
            ):
                break
            time.sleep(2)
        logs = {
            svc: self.daemon.run("logs", "--tail", "15", cid, check=False).stdout
            + self.daemon.run("logs", "--tail", "15", cid, check=False).stderr
            for svc, cid in self.containers().items()
            if state.get(svc) != "running/healthy"
        }
        pytest.fail(f"not healthy: {state}\n" + "\n".join(f"--- {k}\n{v}" for k, v in logs.items()))


@pytest.fixture(scope="module")
def stack(daemon, image, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compose")
    # As `make certs` writes them: readable by the containers' uid (10001), the SANs it adds.
    certs.generate(folder / "certs", extra_sans=make_certs_sans(), key_mode=0o644)
    os.chmod(folder / "certs", 0o755)
    ports = {"PDD_GRPC_PUBLISH": free_port(), "PDD_HTTP_PUBLISH": free_port()}
    s = ComposeStack(daemon, f"pdde2e{uuid.uuid4().hex[:6]}", folder, ports)
    try:
        start = time.monotonic()
        up = s.compose("up", "--detach", "--no-build", timeout=HEALTH_TIMEOUT_S)
        assert up.returncode == 0, up.stdout + up.stderr
        s.wait_healthy(HEALTH_TIMEOUT_S)
        TIMINGS["stack_up_healthy"] = time.monotonic() - start
        yield s
    finally:
        start = time.monotonic()
        down = s.compose("down", "--volumes", "--remove-orphans", "--timeout", "10")
        TIMINGS["stack_down"] = time.monotonic() - start
        assert down.returncode == 0, down.stdout + down.stderr
        assert not s.containers(), "compose down left containers behind"


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of one in-process engine on the stack's model (and its tokenizer)."""
    from transformers import AutoTokenizer

    from pdd.engine.model_source import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    engine = Engine(load_model(MODEL), EngineConfig(block_size=16, kv_cache_bytes=64 * 2**20))

    class Ref:
        def greedy(self, ids: list[int], n: int) -> list[int]:
            return engine.generate([list(ids)], SamplingParams(max_tokens=n, ignore_eos=True))[0]

        def encode(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

    return Ref()


async def _generate(stack: ComposeStack, prompt: list[int], rid: str, n: int, on_tokens=None, **f):
    tokens: list[int] = []
    final = None
    async for resp in generate_stream(
        stack.grpc,
        prompt,
        max_tokens=n,
        ignore_eos=True,
        timeout=300,
        tls=stack.tls,
        request_id=rid,
        cache_salt=rid,
        **f,
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids  # no gap, no repeat
        tokens.extend(resp.token_ids)
        if on_tokens is not None:
            on_tokens(tokens)
        if resp.HasField("stats"):
            final = resp.stats
    assert final is not None
    return tokens, final


async def test_grpc_greedy_through_the_relay_equals_the_reference_and_every_log_has_its_id(
    stack, reference
):
    prompt = reference.encode("The two clusters are joined by a slow link, so the relay")
    rid = f"compose-grpc-{uuid.uuid4().hex[:8]}"
    tokens, stats = await _generate(
        stack, prompt, rid, 24, force_pipeline=common_pb2.PIPELINE_P_RLD_MD
    )
    assert stats.pipeline == common_pb2.PIPELINE_P_RLD_MD
    assert tokens == reference.greedy(prompt, 24)
    # NOTE: the client's stream can end before a service has logged its closing lines.
    deadline = time.monotonic() + 15
    while True:
        found = {svc: stack.lines_of(svc, rid) for svc in (*PATH_SERVICES, *MAIN_DECODES)}
        served = [md for md in MAIN_DECODES if found[md]]
        if (all(found[s] for s in PATH_SERVICES) and served) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(found[s] for s in PATH_SERVICES), {s: len(v) for s, v in found.items()}
    assert len(served) == 1, served
    events = {svc: {d["event"] for d in lines} for svc, lines in found.items()}
    assert {"routed", "request_done"} <= events["gateway"]
    assert "md_accepted" in events[served[0]]


async def test_openai_api_with_the_example_key_equals_the_reference(stack, reference):
    import openai

    key = _env_file(ENV_EXAMPLE)["PDD_API_KEYS"].split(",")[0]
    # HTTPS: the gateway's own TLS identity, from the stack's CA.
    http = openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=stack.tls.ca))
    client = openai.OpenAI(
        base_url=f"{stack.http}/v1", api_key=key, max_retries=0, timeout=300, http_client=http
    )
    text = "Docker compose brings the stack up on one host:"
    r = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert r.choices[0].token_ids == reference.greedy(reference.encode(text), 16)
    bad = openai.OpenAI(
        base_url=f"{stack.http}/v1", api_key="not-the-key", max_retries=0, http_client=http
    )
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


async def test_a_killed_main_decode_container_is_survived_through_the_other(stack, reference):
    prompt = reference.encode("Faults are routine across datacenters; a request whose decoder")
    rid = f"compose-kill-{uuid.uuid4().hex[:8]}"
    n = 96
    victim: list[str] = []

    def kill_once_speaking(tokens: list[int]) -> None:
        # P-MD: MainDecode speaks from output 1; kill it while it still has most to decode.
        if victim or len(tokens) < 3:
            return
        serving = [m for m in MAIN_DECODES if stack.lines_of(m, rid)]
        if len(serving) != 1:
            return  # its md_accepted line not read yet: the next response
        md = serving[0]
        pid = int(stack.inspect(md, "{{.State.Pid}}"))
        os.kill(pid, signal.SIGKILL)  # a crash of the container's process, not a `docker stop`
        victim.append(md)

    start = time.monotonic()
    tokens, stats = await _generate(
        stack, prompt, rid, n, kill_once_speaking, force_pipeline=common_pb2.PIPELINE_P_MD
    )
    TIMINGS["killed_request"] = time.monotonic() - start
    assert victim, "the request ended before its MainDecode was killed"
    assert len(tokens) == n and tokens == reference.greedy(prompt, n)
    assert stats.migrations == 1
    survivor = next(m for m in MAIN_DECODES if m != victim[0])
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    instance = {md: services[md]["environment"]["PDD_INSTANCE_ID"] for md in MAIN_DECODES}
    assert stats.main_decode_instance == instance[survivor]
    (moved,) = [d for d in stack.lines_of("gateway", rid) if d["event"] == "migrated"]
    assert moved["cause"] == "main_decode_lost"
    assert (moved["from_instance"], moved["to_instance"]) == (
        instance[victim[0]],
        instance[survivor],
    )
    # restart: unless-stopped brings the crashed container back.
    deadline = time.monotonic() + 60
    while int(stack.inspect(victim[0], "{{.RestartCount}}")) < 1:
        assert time.monotonic() < deadline, f"{victim[0]} was not restarted"
        time.sleep(1)


def test_the_kubernetes_manifests_commands_run_in_the_image(daemon, image):
    """No API server here (the manifests are validated offline, tests/unit/test_deploy_k8s.py):
    what can run is each container's command and probe, in the image, without the network."""
    docs = [
        d
        for path in sorted((ROOT / "deploy" / "k8s" / "base").rglob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "Deployment"
    ]
    commands = []
    for doc in docs:
        for c in doc["spec"]["template"]["spec"]["containers"]:
            assert c["image"].split(":")[0] == "pdd", c["image"]  # no other image
            commands.append(c["command"])
            probe = (c.get("readinessProbe") or {}).get("exec")
            if probe:
                commands.append(probe["command"][:1])
    script = (
        "import importlib, json, shutil, sys\n"
        "for cmd in json.loads(sys.argv[1]):\n"
        "    if cmd[:2] == ['python', '-m']:\n"
        "        importlib.import_module(cmd[2] + '.__main__').parser().parse_args(cmd[3:])\n"
        "    else:\n"
        "        assert shutil.which(cmd[0]), cmd\n"
        "print('ok', len(json.loads(sys.argv[1])))\n"
    )
    out = daemon.run(
        "run",
        "--rm",
        "--network",
        "none",
        image,
        "python",
        "-c",
        script,
        json.dumps(commands),
        check=False,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == f"ok {len(commands)}", out.stderr
    assert len(docs) == 6
