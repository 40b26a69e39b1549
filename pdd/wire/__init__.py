"""Proto ↔ domain converters, one module per proto domain.

Every servicer and client converts through these modules only; validation of
incoming messages happens here and raises ``InvalidArgumentError`` naming the
field, so every RPC rejects bad input the same way.
"""
