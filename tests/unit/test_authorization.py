"""``pdd.server.authorization``: a rule for every RPC of every service, and the role read from a
certificate's name. (The interceptor on a real mutual-TLS server:
``tests/integration/test_tls_authorization.py``.)"""

from __future__ import annotations

import pytest

from pdd.gen.gateway.v1 import gateway_service_pb2 as gateway
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as kvstore
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as main_decode
from pdd.gen.prefill.v1 import prefill_service_pb2 as prefill
from pdd.gen.relay.v1 import relay_service_pb2 as relay
from pdd.server import authorization as auth
from pdd.server.tls import TlsConfig

METHODS = [
    f"/{svc.full_name}/{m.name}"
    for mod in (gateway, kvstore, prefill, relay, main_decode)
    for svc in mod.DESCRIPTOR.services_by_name.values()
    for m in svc.methods
]


def test_every_rpc_of_every_service_has_a_rule_and_no_rule_is_stale():
    assert sorted(auth.CALLERS) == sorted(METHODS)


@pytest.mark.parametrize(
    ("method", "role", "may"),
    [
        ("/pdd.main_decode.v1.MainDecodeService/PushKv", "prefill", True),
        ("/pdd.main_decode.v1.MainDecodeService/PushKv", "gateway", False),
        ("/pdd.main_decode.v1.MainDecodeService/PushKv", "relay", False),
        ("/pdd.main_decode.v1.MainDecodeService/TokenHandoff", "relay", True),
        ("/pdd.main_decode.v1.MainDecodeService/TokenHandoff", "gateway", True),
        ("/pdd.main_decode.v1.MainDecodeService/TokenHandoff", "prefill", False),
        ("/pdd.main_decode.v1.MainDecodeService/DecodeMany", "client", False),
        ("/pdd.relay.v1.RelayService/PrepareTransfer", "prefill", True),
        ("/pdd.relay.v1.RelayService/Decode", "prefill", False),
        ("/pdd.prefill.v1.PrefillService/BindMainDecode", "gateway", True),
        ("/pdd.prefill.v1.PrefillService/BindMainDecode", "main_decode", False),
        ("/pdd.kvstore.v1.KvstoreService/Heartbeat", "relay", True),
        ("/pdd.kvstore.v1.KvstoreService/Heartbeat", "client", False),
        ("/pdd.kvstore.v1.KvstoreService/PredictHits", "gateway", True),
        ("/pdd.unknown.v1.X/Y", "gateway", False),  # no rule: nobody
    ],
)
def test_who_may_call_what(method, role, may):
    roles = auth.allowed(method)
    assert roles is not None and (role in roles) is may


def test_the_public_api_health_and_reflection_take_any_caller():
    assert auth.allowed("/pdd.gateway.v1.GatewayService/Generate") is None
    assert auth.allowed("/grpc.health.v1.Health/Check") is None
    assert auth.allowed("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is None


def test_the_role_is_the_certificates_common_name():
    assert auth.role_of({"x509_common_name": [b"main-decode"]}) == "main_decode"
    assert auth.role_of({"x509_common_name": [b"prefill"]}) == "prefill"
    assert auth.role_of({"transport_security_type": [b"ssl"]}) == ""


def test_authorizing_needs_mutual_tls():
    with pytest.raises(ValueError, match="tls_authorize: needs mutual TLS"):
        TlsConfig(cert="a.crt", key="a.key", ca="ca.crt", authorize=True)
    TlsConfig(cert="a.crt", key="a.key", ca="ca.crt", require_client_cert=True, authorize=True)
