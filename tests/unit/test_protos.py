"""The contracts: stubs match protos/, protos pass buf lint, every RPC exists."""

import os
import shutil
import subprocess
import sys
import warnings

import pytest

from pdd.gen.gateway.v1 import gateway_service_pb2 as gateway
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as kvstore
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as main_decode
from pdd.gen.prefill.v1 import prefill_service_pb2 as prefill
from pdd.gen.relay.v1 import relay_service_pb2 as relay
from tests.conftest import ROOT


def test_generated_stubs_match_protos():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _buf() -> str | None:
    local = ROOT / ".tools" / "node_modules" / ".bin" / "buf"
    return str(local) if local.exists() else shutil.which("buf")


def _need_buf() -> str:
    buf = _buf()
    if buf is None:
        if os.environ.get("CI"):
            pytest.fail("buf is not installed (make tools installs it from npm)")
        pytest.skip("buf is not installed; `make tools` installs it")
    return buf


def test_buf_lint_standard():
    out = subprocess.run([_need_buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _breaking_baseline() -> str:
    """The commit to compare protos/ against: the previous one, else (a shallow or one-commit
    clone, or a previous commit without buf.yaml) HEAD itself, which still catches uncommitted
    breaking edits — and a warning says so."""
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: nothing to compare protos/ against")
    if _git("cat-file", "-e", "HEAD~1:buf.yaml").returncode == 0:
        return "HEAD~1"
    warnings.warn(
        UserWarning(
            "buf breaking: no previous commit with buf.yaml in this clone (shallow or first "
            "commit); comparing protos/ against HEAD instead"
        ),
        stacklevel=2,
    )
    return "HEAD"


def test_buf_breaking_against_the_previous_commit():
    buf = _need_buf()
    ref = _breaking_baseline()
    out = subprocess.run(
        [buf, "breaking", "--against", f".git#ref={ref}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, (
        f"breaking change in protos/ against {ref}:\n{out.stdout}{out.stderr}"
    )


def test_buf_breaking_catches_a_removed_field(tmp_path):
    """The check is live: dropping a field of the gateway's request is reported."""
    buf = _need_buf()
    changed = tmp_path / "changed"
    shutil.copytree(ROOT / "protos", changed / "protos")
    shutil.copy(ROOT / "buf.yaml", changed / "buf.yaml")
    proto = changed / "protos" / "pdd" / "gateway" / "v1" / "gateway_service.proto"
    text = proto.read_text()
    assert "  bool ignore_eos = 13;\n" in text
    proto.write_text(text.replace("  bool ignore_eos = 13;\n", ""))
    out = subprocess.run(
        [buf, "breaking", str(changed), "--against", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "ignore_eos" in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("module", "service", "rpcs"),
    [
        (gateway, "GatewayService", {"Generate", "GetModelInfo"}),
        (
            kvstore,
            "KvstoreService",
            {
                "RegisterInstance",
                "Heartbeat",
                "DeregisterInstance",
                "ListInstances",
                "PublishCacheEvents",
                "PredictHits",
            },
        ),
        (prefill, "PrefillService", {"Prefill", "BindMainDecode", "DescribeCache"}),
        (
            relay,
            "RelayService",
            {"Decode", "PrepareTransfer", "PushKv", "CompleteTransfer", "DescribeCache"},
        ),
        (
            main_decode,
            "MainDecodeService",
            {
                "Decode",
                "DecodeMany",
                "PushKv",
                "GetKvTransfer",
                "WaitKvReady",
                "TokenHandoff",
                "DescribeCache",
            },
        ),
    ],
)
def test_every_rpc_exists(module, service, rpcs):
    desc = module.DESCRIPTOR.services_by_name[service]
    assert {m.name for m in desc.methods} == rpcs


def test_streaming_shapes():
    gen = gateway.DESCRIPTOR.services_by_name["GatewayService"].methods_by_name["Generate"]
    assert gen.server_streaming and not gen.client_streaming
    push = main_decode.DESCRIPTOR.services_by_name["MainDecodeService"].methods_by_name["PushKv"]
    assert push.client_streaming and not push.server_streaming
    handoff = main_decode.DESCRIPTOR.services_by_name["MainDecodeService"].methods_by_name[
        "TokenHandoff"
    ]
    assert handoff.client_streaming and handoff.server_streaming


def test_generate_request_round_trip():
    req = gateway.GenerateRequest(
        prompt_token_ids=gateway.PromptTokenIds(token_ids=[1, 2, 3]),
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        stop_token_ids=[2],
        session_id="s",
        cache_salt="t",
        force_pipeline=1,
        handoff_mode=2,
    )
    back = gateway.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("input") == "prompt_token_ids"
    assert back.HasField("seed") and not gateway.GenerateRequest().HasField("seed")
