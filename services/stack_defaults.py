"""Defaults that every service of one stack must agree on, each written once."""

from __future__ import annotations

# NOTE: kvstore's own default port on this host (services.kvstore DEFAULT_PORT): where the
# gateway and every engine-bearing service find the index unless told otherwise.
KVSTORE_ADDRESS = "127.0.0.1:50051"
# The model the gateway tokenizes for and the engines serve: they must match.
MODEL = "smollm2"
