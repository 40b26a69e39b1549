"""The Kubernetes manifests (deploy/k8s), validated offline.

Every manifest validates (strictly) against the Kubernetes API schemas that the
``kubernetes-validate`` package ships; the kustomizations' resource trees put the relay,
prefill, kvstore, Redis and the gateway in the main cluster and main-decode in the remote one;
probes are native gRPC; every ``PDD_*`` name is one the code reads. Where ``kubectl`` is on
PATH, the overlays are also rendered (``kubectl kustomize``, offline) and their output validated.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdd.server.settings import env_names
from pdd.tools import certs
from tests.conftest import ROOT

K8S = ROOT / "deploy" / "k8s"
# Native gRPC probes are GA from 1.27; validate against a current API.
K8S_VERSION = "1.32"
MAIN = {"redis", "kvstore", "prefill", "relay", "gateway"}
REMOTE = {"main-decode"}
# services/<module> each PDD Deployment runs (the entry points `pdd up` starts).
MODULES = {
    "kvstore": "services.kvstore",
    "prefill": "services.prefill",
    "relay": "services.relay",
    "gateway": "services.gateway",
    "main-decode": "services.main_decode",
}


def _code_text() -> str:
    return "\n".join(
        p.read_text()
        for folder in ("pdd", "services")
        for p in (ROOT / folder).rglob("*.py")
        if "gen" not in p.relative_to(ROOT).parts
    )


@pytest.fixture(scope="module")
def validate():
    try:
        import kubernetes_validate as kv
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed (it is in the dev extras)")
        pytest.skip("kubernetes-validate is not installed: pip install -e '.[dev]'")

    def check(doc: dict) -> None:
        kv.validate(doc, K8S_VERSION, strict=True)

    return check


def load_tree(folder: Path) -> list[dict]:
    """The resources a kustomization lists, following directories (kustomize's own order aside)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        assert path.exists(), f"{folder}: resource {entry} does not exist"
        if path.is_dir():
            docs += load_tree(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def components(docs: list[dict], kind: str) -> dict[str, dict]:
    prefix = "pdd-"
    return {d["metadata"]["name"].removeprefix(prefix): d for d in docs if d["kind"] == kind}


def manifest_files() -> list[Path]:
    return sorted(p for p in (K8S / "base").rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates_against_the_api_schema(path, validate):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize(
    ("overlay", "expected"),
    [("base", MAIN | REMOTE), ("overlays/main", MAIN), ("overlays/remote", REMOTE)],
)
def test_each_cluster_gets_its_half(overlay, expected):
    docs = load_tree(K8S / overlay)
    deployments, services = components(docs, "Deployment"), components(docs, "Service")
    assert set(deployments) == expected and set(services) == expected
    assert set(components(docs, "ConfigMap")) == {"config"}
    for name, dep in deployments.items():
        selector = dep["spec"]["template"]["spec"]["nodeSelector"]
        assert selector == {"pdd/cluster": "main" if name in MAIN else "remote"}, name
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert services[name]["spec"]["selector"].items() <= labels.items(), (
            f"Service {name} selects no pod"
        )


def test_pdd_deployments_run_the_entry_points_with_native_grpc_probes():
    docs = load_tree(K8S / "base")
    config = components(docs, "ConfigMap")["config"]["data"]
    health_port = int(config["PDD_HEALTH_PORT"])
    for name, dep in components(docs, "Deployment").items():
        if name == "redis":
            continue
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert container["command"][:3] == ["python", "-m", MODULES[name]], name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["grpc"] == {"port": health_port}, f"{name}: {probe}"
        env = {e["name"]: e for e in container["env"]}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(env["PDD_PORT"]["value"]) == ports["grpc"] and ports["health"] == health_port
        assert container["envFrom"] == [{"configMapRef": {"name": "pdd-config"}}]


def test_tls_everywhere_with_each_service_mounting_only_its_own_key():
    docs = load_tree(K8S / "base")
    config = components(docs, "ConfigMap")["config"]["data"]
    assert config["PDD_TLS_CLIENT_AUTH"] == "true"
    # Peers are dialled by pod IP or WAN endpoint: every certificate carries the mesh name.
    assert config["PDD_TLS_SERVER_NAME"] == certs.MESH_NAME
    mount = Path(config["PDD_TLS_CA"]).parent
    for name, dep in components(docs, "Deployment").items():
        if name == "redis":
            continue
        spec = dep["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (
            env["PDD_TLS_CERT"] == f"{mount}/{name}.crt"
            and env["PDD_TLS_KEY"] == f"{mount}/{name}.key"
        )
        assert name in certs.SERVICES
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "pdd-tls"
        assert {i["key"] for i in volume["secret"]["items"]} == {
            "ca.crt",
            f"{name}.crt",
            f"{name}.key",
        }
        assert {"name": volume["name"], "mountPath": str(mount), "readOnly": True} in container[
            "volumeMounts"
        ]
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_every_pdd_env_name_is_read_by_the_code():
    docs = load_tree(K8S / "base")
    names = set(components(docs, "ConfigMap")["config"]["data"])
    for dep in components(docs, "Deployment").values():
        for container in dep["spec"]["template"]["spec"]["containers"]:
            names |= {e["name"] for e in container.get("env", [])}
    code = _code_text()
    # NOTE: a service's flags derive their env names (pdd.server.settings): ask its parser.
    read = set().union(
        *(env_names(importlib.import_module(f"{m}.__main__").parser()) for m in MODULES.values())
    )
    unknown = sorted(
        n for n in names if n.startswith("PDD_") and n not in read and f'"{n}"' not in code
    )
    assert not unknown, f"no code reads {unknown}"


def _kubectl() -> str | None:
    return shutil.which("kubectl")


@pytest.mark.parametrize("overlay", ["base", "overlays/main", "overlays/remote"])
def test_kustomize_renders_and_the_output_validates(overlay, validate):
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip(
            "kubectl is not installed: the kustomizations were checked as trees, not rendered"
        )
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / overlay)],
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
    services, deployments = components(docs, "Service"), components(docs, "Deployment")
    config = components(docs, "ConfigMap")["config"]["data"]
    if overlay == "overlays/main":
        assert (
            services["kvstore"]["spec"]["type"] == "LoadBalancer"
        )  # main-decode dials it across the WAN
    if overlay == "overlays/remote":
        assert services["main-decode"]["spec"]["type"] == "LoadBalancer"
        assert (
            config["PDD_KVSTORE"].endswith(":50051")
            and config["PDD_KVSTORE"] != "pdd-kvstore:50051"
        )
        (container,) = deployments["main-decode"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (
            env["PDD_ADVERTISE_ADDRESS"].endswith(":50054")
            and "pdd-main-decode" not in env["PDD_ADVERTISE_ADDRESS"]
        )
