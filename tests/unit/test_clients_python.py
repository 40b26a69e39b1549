"""The ``pdd-client`` package stands alone: imports without torch or ``pdd``, builds as a wheel
whose only requirements are grpcio and protobuf, and speaks the same wire format as the server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from pdd.gen.gateway.v1 import gateway_service_pb2 as server_pb
from tests.conftest import ROOT

CLIENT = ROOT / "clients" / "python"

# Runs under `python -I` (no cwd, no PYTHONPATH): torch and the server package cannot be imported.
GUARD = f"""
import sys
sys.modules["torch"] = None
sys.modules["pdd"] = None
sys.path.insert(0, {str(CLIENT)!r})
"""


def run_isolated(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-c", GUARD + code], capture_output=True, text=True, timeout=60
    )


def test_guard_really_blocks_torch():
    out = run_isolated("import torch")
    assert out.returncode != 0 and (
        "ModuleNotFoundError" in out.stderr or "ImportError" in out.stderr
    )


def test_imports_and_builds_requests_without_torch_or_the_server_package():
    out = run_isolated("""
import pdd_client
from pdd_client import generate_request, common_pb2
req = generate_request([1, 2, 3], max_tokens=8, seed=42, ignore_eos=True, cache_salt="t",
                       force_pipeline=common_pb2.PIPELINE_P_RLD_MD)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pdd", "numpy", "redis"))
assert not [m for m in loaded if sys.modules[m] is not None], loaded
sys.stdout.write(req.SerializeToString().hex())
""")
    assert out.returncode == 0, out.stderr
    expected = server_pb.GenerateRequest(
        prompt_token_ids=server_pb.PromptTokenIds(token_ids=[1, 2, 3]),
        max_tokens=8,
        seed=42,
        ignore_eos=True,
        cache_salt="t",
        force_pipeline=2,
    )
    assert server_pb.GenerateRequest.FromString(bytes.fromhex(out.stdout)) == expected


def test_text_prompt_and_tls_options_validate():
    out = run_isolated("""
from pdd_client import TlsOptions, generate_request
assert generate_request("hi").prompt == "hi"
assert not generate_request("hi").HasField("seed")
try:
    TlsOptions(cert="a.crt")
except ValueError as e:
    print(e)
""")
    assert out.returncode == 0, out.stderr
    assert "cert and key go together" in out.stdout


def test_requirements_are_grpcio_and_protobuf_only():
    meta = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["dependencies"]}
    assert names == {"grpcio", "protobuf"}


def test_builds_a_wheel_with_its_stubs(tmp_path):
    # NOTE: built from a copy: setuptools leaves build/ and *.egg-info beside the sources.
    src = shutil.copytree(
        CLIENT,
        tmp_path / "src",
        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"),
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0 and "No module named setuptools" in out.stderr + out.stdout:
        pytest.skip("setuptools is not installed in this venv")
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("pdd_client-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "pdd_client/client.py",
        "pdd_client/gen/gateway/v1/gateway_service_pb2.py",
        "pdd_client/gen/gateway/v1/gateway_service_pb2_grpc.py",
        "pdd_client/gen/common/v1/common_pb2.py",
        "pdd_client/gen/gateway/v1/gateway_service_pb2.pyi",
        "pdd_client/py.typed",
    } <= names
    assert not any(n.startswith("pdd/") for n in names)
    (meta,) = [n for n in names if n.endswith("METADATA")]
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert sorted(requires) == [
        "Requires-Dist: grpcio>=1.85.1",
        "Requires-Dist: protobuf<8,>=7.35.1",
    ]
