"""The wire: proto ↔ domain converters, one module per proto domain, and the typed peer clients.

Converters (``common``, ``gateway``, ``kvstore``, ``prefill``, ``relay``, ``main_decode``):
every servicer and client converts through these only; incoming messages are validated here
and raise ``InvalidArgumentError`` naming the field, so every RPC rejects bad input the same
way. Clients (``kvstore_client``, ``prefill_client``, ``relay_client``,
``main_decode_client``, over ``call``): domain records in, domain records out, ``PeerError``
instead of gRPC's exceptions — what ``pdd.serving`` talks to. The KV transfer's own messages
are ``pdd.kv.messages``.
"""
