"""``--tls-authorize`` on a real server: under mutual TLS each RPC is taken only from the roles
that call it in a request's life, the role read from the caller's certificate.

kvstore (real Redis) is the server under test, with the certificates ``make certs`` writes: an
engine (MainDecode) registers through ``Membership``; the gateway and an operator's client may
read the index but not write it; every refusal is PERMISSION_DENIED naming the role and RPC.
The rule for every RPC of every service is checked in ``tests/unit/test_authorization.py``.
"""

from __future__ import annotations

import grpc
import pytest

from pdd.core.instance import Instance, InstanceRef, Role
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.server.tls import open_channel
from pdd.serving.membership import Membership
from pdd.wire.kvstore_client import KvstoreClient
from tests.integration.test_tls import identity, kvstore, pki  # noqa: F401 — fixtures

AUTHORIZED = pytest.mark.parametrize("kvstore", ["authorize"], indirect=True, ids=["authz"])


def _deregister(instance_id: str) -> pb.DeregisterInstanceRequest:
    return pb.DeregisterInstanceRequest(instance_id=instance_id)


@AUTHORIZED
async def test_an_engine_registers_and_readers_read_but_never_write(kvstore, pki):  # noqa: F811
    _, kvstore = kvstore
    folder, _ = pki
    md = Instance(InstanceRef("md-auth", "127.0.0.1:1", Role.MAIN_DECODE, "remote"), 4, "tiny")
    channel = open_channel(kvstore, identity(folder, "main-decode"))
    member = Membership(KvstoreClient(channel), md, ttl_ms=60_000)
    try:
        await member.start()  # RegisterInstance and PublishCacheEvents as an engine
        for reader in ("gateway", "client"):
            async with open_channel(kvstore, identity(folder, reader)) as ch:
                stub = pb_grpc.KvstoreServiceStub(ch)
                listed = await stub.ListInstances(pb.ListInstancesRequest(), timeout=5)
                assert [i.ref.instance_id for i in listed.instances] == ["md-auth"]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.DeregisterInstance(_deregister("md-auth"), timeout=5)
                assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
                assert f"role '{reader}' may not call DeregisterInstance" in err.value.details()
                assert "main_decode" in err.value.details()  # who may
        # what the readers were refused changed nothing
        async with open_channel(kvstore, identity(folder, "client")) as ch:
            listed = await pb_grpc.KvstoreServiceStub(ch).ListInstances(
                pb.ListInstancesRequest(), timeout=5
            )
            assert [i.ref.instance_id for i in listed.instances] == ["md-auth"]
    finally:
        await member.stop()
        await channel.close()


@AUTHORIZED
async def test_a_prefill_may_not_predict_and_health_is_open_to_every_role(kvstore, pki):  # noqa: F811
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, kvstore = kvstore
    folder, _ = pki
    async with open_channel(kvstore, identity(folder, "prefill")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.KvstoreServiceStub(ch).PredictHits(pb.PredictHitsRequest(), timeout=5)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "role 'prefill' may not call PredictHits" in err.value.details()
        check = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert check.status == health_pb2.HealthCheckResponse.SERVING
