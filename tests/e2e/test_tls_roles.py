"""The whole stack under mutual TLS with a certificate per role and ``--tls-authorize``: every
call a request's life makes is one its caller's role may make (or no token flows), and a
certificate of the wrong role is refused where it does not belong.

``StackConfig.tls_dir`` gives each process its own role's certificate from ``make certs``.
"""

from __future__ import annotations

import grpc
import pytest

from pdd.client import generate_stream
from pdd.core.pipeline import Pipeline
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import DecodeJob
from pdd.gen.common.v1 import common_pb2
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.server.tls import TlsConfig, open_channel
from pdd.tools import certs
from pdd.wire import main_decode as md_conv
from tests.e2e.conftest import make_stack

PROMPT = [7, 19, 3, 88, 41, 12, 60, 5, 33, 90, 2]


@pytest.fixture(scope="module")
def role_stack(redis_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("role-certs")
    certs.generate(folder)
    stack = make_stack(redis_url, tmp_path_factory.mktemp("tls-roles"), tls_dir=str(folder))
    yield stack, folder
    codes = stack.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


def _identity(folder, role: str) -> TlsConfig:
    return TlsConfig(
        cert=str(folder / f"{role}.crt"), key=str(folder / f"{role}.key"), ca=str(folder / "ca.crt")
    )


@pytest.mark.parametrize(
    "pipeline", [common_pb2.PIPELINE_P_RLD_MD, common_pb2.PIPELINE_P_MD], ids=["p-rld-md", "p-md"]
)
async def test_every_hop_of_a_request_is_a_call_its_role_may_make(role_stack, pipeline):
    stack, folder = role_stack
    tokens, final = [], None
    async for resp in generate_stream(
        stack.gateway.address,
        PROMPT,
        max_tokens=12,
        timeout=120,
        ignore_eos=True,
        tls=_identity(folder, "client"),
        force_pipeline=pipeline,
        handoff_mode=common_pb2.HANDOFF_MODE_ONE_SHOT,
        cache_salt=f"roles-{pipeline}",
    ):
        tokens.extend(resp.token_ids)
        if resp.HasField("stats"):
            final = resp.stats
    assert len(tokens) == 12 and final is not None and final.pipeline == pipeline
    assert final.rld_tokens + final.md_tokens == 11 and final.migrations == 0
    # NOTE: runs before the refusals below (file order): no hop was refused on the way
    for proc in stack.processes:
        if proc.log_path is not None and proc.log_path.exists():
            assert "PERMISSION_DENIED" not in proc.log_path.read_text(), proc.name


@pytest.mark.parametrize("role", ["prefill", "client", "relay"])
async def test_a_certificate_of_another_role_cannot_open_a_decode(role_stack, role):
    stack, folder = role_stack
    job = DecodeJob("intruder", tuple(PROMPT), SamplingParams(max_tokens=4), "", Pipeline.P_MD)
    address = stack.by_name("main_decode-0").address
    async with open_channel(address, _identity(folder, role)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in md_grpc.MainDecodeServiceStub(ch).Decode(
                md_conv.job_to_pb(job), timeout=10
            ):
                pass
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert f"role '{role}' may not call Decode" in err.value.details()
