"""The records every layer shares: torch-free, gRPC-free, Redis-free.

``pipeline`` (Pipeline, HandoffMode, Stage), ``instance`` (who serves where, how loaded),
``request`` (a gateway request, its events and stats), ``stage_events`` (what prefill, relay
and MainDecode are asked and answer), ``sampling_params``, ``cache_event``, ``block_hash``,
``model_info``, ``errors``. See docs/architecture.md for what may import what.
"""
