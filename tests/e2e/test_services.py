"""Every service of a running stack: health, and malformed requests to every RPC."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as kv_pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as kv_grpc
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.gen.prefill.v1 import prefill_service_pb2 as p_pb
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as p_grpc
from pdd.gen.relay.v1 import relay_service_pb2 as r_pb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as r_grpc

SERVICES = {
    "gateway": "pdd.gateway.v1.GatewayService",
    "kvstore": "pdd.kvstore.v1.KvstoreService",
    "prefill-0": "pdd.prefill.v1.PrefillService",
    "relay-0": "pdd.relay.v1.RelayService",
    "main_decode-0": "pdd.main_decode.v1.MainDecodeService",
}


@pytest.mark.parametrize("name", list(SERVICES))
async def test_every_service_is_serving(stack, name):
    async with grpc.aio.insecure_channel(stack.by_name(name).address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICES[name]):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_every_role_registered_with_its_cluster(stack):
    async with grpc.aio.insecure_channel(stack.by_name("kvstore").address) as ch:
        resp = await kv_grpc.KvstoreServiceStub(ch).ListInstances(kv_pb.ListInstancesRequest())
    got = {(i.ref.instance_id, i.ref.role, i.ref.cluster) for i in resp.instances}
    assert got == {
        ("prefill-0", common_pb2.ROLE_PREFILL, "main"),
        ("relay-0", common_pb2.ROLE_RELAY, "main"),
        ("main_decode-0", common_pb2.ROLE_MAIN_DECODE, "remote"),
    }
    md = next(i for i in resp.instances if i.ref.role == common_pb2.ROLE_MAIN_DECODE)
    assert md.ref.address == stack.by_name("wan-0").address  # reached through the WAN emulator


def _ref(address: str, role: int) -> common_pb2.InstanceRef:
    return common_pb2.InstanceRef(instance_id="x", address=address, role=role)


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=4)


async def _unary_stream(call):
    async for _ in call:
        pass


CASES = [
    (
        "prefill-0",
        p_grpc.PrefillServiceStub,
        "Prefill",
        p_pb.PrefillRequest(prompt_token_ids=[1], sampling=_sampling(), pipeline=1),
        "request_id",
    ),
    (
        "prefill-0",
        p_grpc.PrefillServiceStub,
        "Prefill",
        p_pb.PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=_sampling()),
        "pipeline",
    ),
    (
        "prefill-0",
        p_grpc.PrefillServiceStub,
        "Prefill",
        p_pb.PrefillRequest(
            request_id="r",
            prompt_token_ids=[1],
            sampling=common_pb2.SamplingParams(),
            pipeline=1,
            main_decode=_ref("h:1", common_pb2.ROLE_MAIN_DECODE),
        ),
        "sampling.max_tokens",
    ),
    (
        "prefill-0",
        p_grpc.PrefillServiceStub,
        "Prefill",
        p_pb.PrefillRequest(
            request_id="r",
            prompt_token_ids=[1],
            sampling=_sampling(),
            pipeline=2,
            main_decode=_ref("h:1", common_pb2.ROLE_MAIN_DECODE),
        ),
        "relay",
    ),
    (
        "prefill-0",
        p_grpc.PrefillServiceStub,
        "Prefill",
        p_pb.PrefillRequest(
            request_id="r",
            prompt_token_ids=[1],
            sampling=_sampling(),
            pipeline=3,
            main_decode=_ref("h:1", common_pb2.ROLE_MAIN_DECODE),
        ),
        "pipeline",
    ),
    (
        "relay-0",
        r_grpc.RelayServiceStub,
        "Decode",
        r_pb.DecodeRequest(request_id="r", prompt_token_ids=[1], sampling=_sampling()),
        "main_decode",
    ),
    (
        "relay-0",
        r_grpc.RelayServiceStub,
        "Decode",
        r_pb.DecodeRequest(
            request_id="r",
            prompt_token_ids=[100000],
            sampling=_sampling(),
            main_decode=_ref("h:1", common_pb2.ROLE_MAIN_DECODE),
        ),
        "prompt_token_ids[0]",
    ),
    (
        "main_decode-0",
        md_grpc.MainDecodeServiceStub,
        "Decode",
        md_pb.DecodeRequest(request_id="r", prompt_token_ids=[], sampling=_sampling(), pipeline=1),
        "prompt_token_ids",
    ),
    (
        "main_decode-0",
        md_grpc.MainDecodeServiceStub,
        "Decode",
        md_pb.DecodeRequest(
            request_id="r",
            prompt_token_ids=[1],
            sampling=common_pb2.SamplingParams(max_tokens=4, top_p=2.0),
            pipeline=1,
        ),
        "sampling.top_p",
    ),
]


@pytest.mark.parametrize(("service", "stub_cls", "rpc", "request_", "field"), CASES)
async def test_malformed_stage_requests_are_invalid_argument(
    stack, service, stub_cls, rpc, request_, field
):
    async with grpc.aio.insecure_channel(stack.by_name(service).address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _unary_stream(getattr(stub_cls(ch), rpc)(request_, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


async def test_malformed_kv_push_and_handoff(stack):
    async with grpc.aio.insecure_channel(stack.by_name("main_decode-0").address) as ch:
        md = md_grpc.MainDecodeServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await md.PushKv(
                iter([md_pb.PushKvRequest(chunk=common_pb2.KvChunk(request_id="r", data=b"x"))]),
                timeout=10,
            )
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in err.value.details()
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _unary_stream(
                md.TokenHandoff(iter([md_pb.TokenHandoffRequest(token_ids=[1])]), timeout=10)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("handoff[0].request_id")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await md.WaitKvReady(
                md_pb.WaitKvReadyRequest(request_id="nobody", timeout_ms=10), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
