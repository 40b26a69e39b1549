"""Which role may call which RPC, read from the caller's certificate under mutual TLS.

Mutual TLS alone says a caller holds *a* certificate from the deployment's CA; any of them could
then push KV into a MainDecode or hand it tokens. With ``--tls-authorize`` each call is also
checked against ``CALLERS``: the caller's role is its certificate's common name (``make certs``
issues ``CN=prefill``, ``CN=main-decode``, …; ``-`` and ``_`` are the same), and only the roles
that call an RPC in a request's life may call it — prefill pushes KV, the gateway opens decodes,
the relay and the gateway hand tokens over, engines register with kvstore. Anything else is
PERMISSION_DENIED naming the role and the RPC. The public API (``GatewayService``) and the
health and reflection services take any verified caller.

Every RPC of every PDD service has a rule (a test checks it), so a new RPC is refused until its
callers are written down here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc

from pdd.server.handlers import wrap_handler

# NOTE: kvstore calls no one, so it has no role here.
GATEWAY, PREFILL, RELAY, MAIN_DECODE, CLIENT = (
    "gateway",
    "prefill",
    "relay",
    "main_decode",
    "client",
)
ENGINES = frozenset({PREFILL, RELAY, MAIN_DECODE})
# Reading what a stage or the index holds: the gateway, and an operator's client.
READERS = frozenset({GATEWAY, CLIENT})

# Full method name → the roles that may call it (None: any verified caller).
CALLERS: dict[str, frozenset[str] | None] = {
    "/pdd.gateway.v1.GatewayService/Generate": None,
    "/pdd.gateway.v1.GatewayService/GetModelInfo": None,
    "/pdd.kvstore.v1.KvstoreService/RegisterInstance": ENGINES,
    "/pdd.kvstore.v1.KvstoreService/Heartbeat": ENGINES,
    "/pdd.kvstore.v1.KvstoreService/DeregisterInstance": ENGINES,
    "/pdd.kvstore.v1.KvstoreService/PublishCacheEvents": ENGINES,
    "/pdd.kvstore.v1.KvstoreService/ListInstances": READERS | ENGINES,
    "/pdd.kvstore.v1.KvstoreService/PredictHits": READERS,
    "/pdd.prefill.v1.PrefillService/Prefill": frozenset({GATEWAY}),
    "/pdd.prefill.v1.PrefillService/BindMainDecode": frozenset({GATEWAY}),
    "/pdd.prefill.v1.PrefillService/DescribeCache": READERS,
    "/pdd.relay.v1.RelayService/Decode": frozenset({GATEWAY}),
    "/pdd.relay.v1.RelayService/PrepareTransfer": frozenset({PREFILL}),
    "/pdd.relay.v1.RelayService/PushKv": frozenset({PREFILL}),
    "/pdd.relay.v1.RelayService/CompleteTransfer": frozenset({PREFILL}),
    "/pdd.relay.v1.RelayService/DescribeCache": READERS,
    "/pdd.main_decode.v1.MainDecodeService/Decode": frozenset({GATEWAY}),
    "/pdd.main_decode.v1.MainDecodeService/DecodeMany": frozenset({GATEWAY}),
    "/pdd.main_decode.v1.MainDecodeService/PushKv": frozenset({PREFILL}),
    "/pdd.main_decode.v1.MainDecodeService/GetKvTransfer": frozenset({PREFILL}),
    "/pdd.main_decode.v1.MainDecodeService/WaitKvReady": frozenset({RELAY, GATEWAY}),
    "/pdd.main_decode.v1.MainDecodeService/TokenHandoff": frozenset({RELAY, GATEWAY}),
    "/pdd.main_decode.v1.MainDecodeService/DescribeCache": READERS,
}
# Services outside PDD's contracts that every verified caller may use.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def allowed(method: str) -> frozenset[str] | None:
    """The roles that may call ``method`` (None: any); an RPC without a rule: nobody."""
    if method.startswith(OPEN_SERVICES):
        return None
    return CALLERS.get(method, frozenset())


def role_of(auth_context: dict[str, list[bytes]]) -> str:
    """The caller's role: its certificate's common name, ``-`` read as ``_``; "" without one."""
    names = auth_context.get("x509_common_name") or []
    return names[0].decode("utf-8", "replace").strip().replace("-", "_") if names else ""


@asynccontextmanager
async def _authorized(
    context: grpc.aio.ServicerContext, method: str, roles: frozenset[str]
) -> AsyncIterator[None]:
    role = role_of(context.auth_context())
    if role not in roles:
        who = f"role {role!r}" if role else "a caller without a certificate name"
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{who} may not call {method.rpartition('/')[2]}: "
            f"it is for {', '.join(sorted(roles)) or 'no role'}",
        )
    yield


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (PERMISSION_DENIED) each call whose caller's role ``CALLERS`` does not list."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        roles = allowed(method)
        if handler is None or roles is None:
            return handler
        return wrap_handler(handler, lambda context: _authorized(context, method, roles))
