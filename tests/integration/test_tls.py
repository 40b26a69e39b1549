"""TLS on real gRPC servers: a TLS channel works, plaintext and unknown clients are refused.

kvstore (real Redis) is the server under test; its clients are the library's own channel
factories (``open_channel``, ``Channels``, ``Membership``), the WAN emulator sits between
them where the deployment has one, and the certificates are the ones ``make certs`` writes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdd.core.instance import Instance, InstanceRef, Role
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from pdd.server.tls import TlsConfig, open_channel
from pdd.serving.channels import Channels
from pdd.serving.membership import Membership
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator
from pdd.tools import certs
from pdd.wire.kvstore_client import KvstoreClient
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build
from tests.conftest import ROOT, free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    certs.generate(out)
    other = tmp_path_factory.mktemp("other-ca")
    certs.generate(other)
    return out, other


def identity(folder, name: str, **over) -> TlsConfig:
    return TlsConfig(
        cert=str(folder / f"{name}.crt"),
        key=str(folder / f"{name}.key"),
        ca=str(folder / "ca.crt"),
        **over,
    )


@pytest.fixture
async def kvstore(redis_url, key_prefix, pki, request):
    """A kvstore server speaking TLS (param True: mutual TLS; "authorize": mutual TLS and role
    authorization, ``test_tls_authorization``)."""
    param = getattr(request, "param", False)
    folder, _ = pki
    served = identity(
        folder,
        "kvstore",
        require_client_cert=bool(param),
        authorize=param == "authorize",
        health_port=free_port(),
    )
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5, tls=served),
        redis_url=redis_url,
        key_prefix=key_prefix,
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    yield server, f"127.0.0.1:{port}"
    await server.stop()


async def _list(channel: grpc.aio.Channel) -> list[str]:
    resp = await pb_grpc.KvstoreServiceStub(channel).ListInstances(
        pb.ListInstancesRequest(), timeout=5
    )
    return [i.ref.instance_id for i in resp.instances]


async def test_tls_channel_works_and_plaintext_is_refused(kvstore, pki):
    _, address = kvstore
    folder, _ = pki
    async with open_channel(address, TlsConfig(ca=str(folder / "ca.crt"))) as ch:
        assert await _list(ch) == []
    async with grpc.aio.insecure_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_refuses_a_server_signed_by_another_ca(kvstore, pki):
    _, address = kvstore
    _, other = pki
    async with open_channel(address, TlsConfig(ca=str(other / "ca.crt"))) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_verifies_the_server_name(kvstore, pki):
    _, address = kvstore
    folder, _ = pki
    ca = str(folder / "ca.crt")
    # kvstore's certificate covers the WAN hop's name and the mesh name, not another service's.
    for name in ("wan-link-kvstore", certs.MESH_NAME, "pdd-kvstore"):
        async with open_channel(address, TlsConfig(ca=ca, server_name=name)) as ch:
            assert await _list(ch) == []
    async with open_channel(address, TlsConfig(ca=ca, server_name="main-decode")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("kvstore", [True], indirect=True, ids=["mtls"])
async def test_mutual_tls_refuses_clients_without_a_trusted_certificate(kvstore, pki):
    server, address = kvstore
    assert server.tls.require_client_cert
    folder, other = pki
    async with open_channel(address, identity(folder, "client")) as ch:
        assert await _list(ch) == []
    for refused in (
        TlsConfig(ca=str(folder / "ca.crt")),  # no certificate at all
        TlsConfig(
            cert=str(other / "client.crt"), key=str(other / "client.key"), ca=str(folder / "ca.crt")
        ),
    ):  # a certificate from another CA
        async with open_channel(address, refused) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _list(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("kvstore", [True], indirect=True, ids=["mtls"])
async def test_membership_registers_through_the_wan_emulator_over_mtls(kvstore, pki):
    """MainDecode → kvstore crosses the WAN: TLS passes through the TCP proxy end to end."""
    _, address = kvstore
    folder, _ = pki
    emulator = LinkEmulator(LinkConfig(delay_ms=5), address)
    hop = await emulator.start()
    md = identity(folder, "main-decode", server_name="wan-link-kvstore")
    channel = open_channel(hop, md)
    member = Membership(
        KvstoreClient(channel),
        Instance(InstanceRef("md-tls", "wan-link:50054", Role.MAIN_DECODE, "remote"), 4, "tiny"),
        ttl_ms=60_000,
    )
    try:
        await member.start()
        async with open_channel(address, identity(folder, "client")) as ch:
            assert await _list(ch) == ["md-tls"]
        assert (
            emulator.connections_total >= 1 and emulator.counter_up.bytes > 0
        )  # it did cross the link
    finally:
        await member.stop()
        await channel.close()
        await emulator.stop()


async def test_channels_use_the_tls_they_are_given(kvstore, pki):
    _, address = kvstore
    folder, _ = pki
    channels = Channels(identity(folder, "gateway"))
    try:
        assert channels.tls == identity(folder, "gateway")
        assert await _list(channels.get(address)) == []
    finally:
        await channels.close()


async def test_health_port_is_plaintext_and_serves_health_only(kvstore):
    server, _ = kvstore
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.tls.health_port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list(ch)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _probe(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDD_TLS_")}
    return subprocess.run(
        [sys.executable, "-m", "pdd.tools.health_probe", address, "--timeout", "5"],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_health_probe_speaks_the_services_tls(kvstore, pki):
    _, address = kvstore
    folder, _ = pki
    # NOTE: in a thread: the server under test runs on this event loop.
    ok = await asyncio.to_thread(
        _probe,
        address,
        {
            "PDD_TLS_CERT": str(folder / "kvstore.crt"),
            "PDD_TLS_KEY": str(folder / "kvstore.key"),
            "PDD_TLS_CA": str(folder / "ca.crt"),
        },
    )
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    plain = await asyncio.to_thread(_probe, address, {})
    assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr, plain.stdout + plain.stderr
