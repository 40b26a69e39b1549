"""The many-clusters deploy shapes: deploy/compose.clusters.yml and deploy/k8s/overlays/remote-slow.

Each adds a second remote cluster, ``slow``, without changing the default stack: in compose one
link service (``wan-link-slow``, a route per direction of the cluster's traffic) in front of its
own MainDecode on its own internal network; in Kubernetes the remote half again, renamed, with
``PDD_CLUSTER=slow`` and its own WAN endpoint. Validated as tests/unit/test_deploy_compose.py and
test_deploy_k8s.py validate the default files: ``docker-compose config`` and the API schemas (and
``kubectl kustomize`` where it is installed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from pdd.testbed.link_emulator import Route
from pdd.tools import certs
from services.wan_link.config import WanLinkConfig
from tests.conftest import ROOT
from tests.unit.test_deploy_compose import COMPOSE, ENV_EXAMPLE, env_of, service_parser
from tests.unit.test_deploy_k8s import K8S, K8S_VERSION, components, load_tree

OVERLAY = ROOT / "deploy" / "compose.clusters.yml"
SLOW = {"wan-link-slow", "main-decode-slow"}


def _cli_or_skip() -> str:
    cli = shutil.which("docker-compose")
    if cli is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed (make tools installs it)")
        pytest.skip("docker-compose is not installed; `make tools` installs it")
    return cli


@pytest.fixture(scope="module")
def merged() -> dict:
    """docker-compose.yml with the overlay, as docker-compose merges them."""
    out = subprocess.run(
        [_cli_or_skip(), "-f", str(COMPOSE), "-f", str(OVERLAY), "config"],
        cwd=ROOT,
        env={**os.environ, "PDD_API_KEYS": "test-key"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return yaml.safe_load(out.stdout)


def test_the_overlay_adds_the_slow_cluster_and_keeps_the_default_stack(merged):
    base = yaml.safe_load(COMPOSE.read_text())
    assert set(merged["services"]) == set(base["services"]) | SLOW
    assert merged["networks"]["remote-slow"] == {"internal": True}
    # The default services run as before, on the networks they had.
    for name in set(base["services"]) - {"prefill", "relay", "gateway"}:
        was, now = base["services"][name], merged["services"][name]
        assert now["command"] == was["command"], name
        assert set(now["networks"]) == set(was["networks"]), name


def _routes(svc: dict) -> list[Route]:
    command = svc["command"]
    assert command[:3] == ["python", "-m", "services.wan_link"]
    routes = tuple(command[i + 1] for i, a in enumerate(command) if a == "--route")
    return WanLinkConfig(routes=routes).parsed_routes()


def test_the_slow_cluster_sits_behind_its_one_link_both_ways(merged):
    services = merged["services"]
    link, md = services["wan-link-slow"], services["main-decode-slow"]
    assert set(link["networks"]) == {"main", "remote-slow"}
    assert set(md["networks"]) == {"remote-slow"}
    env = env_of(md)
    by_upstream = {r.upstream: r.listen.rpartition(":")[2] for r in _routes(link)}
    # main → slow: dialled at the link's route, which forwards to its port.
    port = by_upstream[f"main-decode-slow:{env['PDD_PORT']}"]
    assert env["PDD_ADVERTISE_ADDRESS"] == f"wan-link-slow:{port}"
    # slow → main: its kvstore calls take the same link.
    kv_port = env_of(services["kvstore"])["PDD_PORT"]
    assert env["PDD_KVSTORE"] == f"wan-link-slow:{by_upstream[f'kvstore:{kv_port}']}"
    assert env["PDD_CLUSTER"] == "slow" and env["PDD_INSTANCE_ID"] == "main-decode-slow-0"
    assert env_of(services["main-decode"])["PDD_CLUSTER"] == "remote"
    assert "main-decode-slow" in services["gateway"]["depends_on"]
    # The link's own settings and /metrics.
    link_env = env_of(link)
    assert {"PDD_WAN_MBPS", "PDD_WAN_DELAY_MS", "PDD_METRICS_PORT"} <= set(link_env)
    flags = service_parser("services.wan_link")._option_string_actions
    assert all(a in flags for a in link["command"][3:] if a.startswith("--"))


def test_tls_verifies_the_mesh_name_every_certificate_carries(merged):
    services = merged["services"]
    for name in ("prefill", "relay", "gateway", "main-decode-slow"):
        assert env_of(services[name])["PDD_TLS_SERVER_NAME"] == certs.MESH_NAME, name
    md = env_of(services["main-decode-slow"])
    assert md["PDD_TLS_CERT"] == "/certs/main-decode.crt" and md["PDD_TLS_CLIENT_AUTH"] == "true"
    probe = services["wan-link-slow"]["healthcheck"]["test"]
    assert probe[probe.index("--tls-server-name") + 1] == certs.MESH_NAME
    assert all(certs.MESH_NAME in spec.dns for spec in certs.specs())


def test_the_example_env_file_names_the_overlays_variables():
    text = ENV_EXAMPLE.read_text()
    used = set(re.findall(r"\$\{(\w+)", OVERLAY.read_text()))
    assert {"PDD_WAN_SLOW_MBPS", "PDD_WAN_SLOW_DELAY_MS"} <= used
    missing = sorted(v for v in used if not re.search(rf"^#? ?{v}=", text, re.MULTILINE))
    assert not missing, f"{ENV_EXAMPLE.name} does not mention {missing}"


REMOTE_SLOW = K8S / "overlays" / "remote-slow"


@pytest.fixture(scope="module")
def validate():
    try:
        import kubernetes_validate as kv
    except ImportError:
        pytest.skip("kubernetes-validate is not installed: pip install -e '.[dev]'")
    return lambda doc: kv.validate(doc, K8S_VERSION, strict=True)


def test_the_k8s_overlay_is_the_remote_half_again():
    docs = load_tree(REMOTE_SLOW)
    assert set(components(docs, "Deployment")) == {"main-decode"}
    assert set(components(docs, "Service")) == {"main-decode"}


def test_the_k8s_overlay_renders_a_slow_cluster(validate):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomization was checked as a tree")
    out = subprocess.run(
        [kubectl, "kustomize", str(REMOTE_SLOW)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for doc in docs:
        validate(doc)
        assert doc["metadata"]["namespace"] == "pdd"
    deployments, services = components(docs, "Deployment"), components(docs, "Service")
    assert set(deployments) == {"main-decode-slow"} and set(services) == {"main-decode-slow"}
    dep, svc = deployments["main-decode-slow"], services["main-decode-slow"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDD_CLUSTER"] == "slow"
    assert (
        env["PDD_ADVERTISE_ADDRESS"].endswith(":50054")
        and "pdd-main-decode" not in (env["PDD_ADVERTISE_ADDRESS"])
    )
    # Its Service selects its own pods only; it reads its own (renamed) ConfigMap.
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["selector"]["pdd/remote-cluster"] == "slow"
    assert svc["spec"]["type"] == "LoadBalancer"
    config = components(docs, "ConfigMap")["config-slow"]["data"]
    assert container["envFrom"] == [{"configMapRef": {"name": "pdd-config-slow"}}]
    assert config["PDD_KVSTORE"].endswith(":50051") and config["PDD_KVSTORE"] != "pdd-kvstore:50051"
    # The TLS secret is the one `make certs` material goes into, not renamed.
    (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "pdd-tls"
