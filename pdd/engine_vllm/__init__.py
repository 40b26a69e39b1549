"""PDD's engine boundary (``pdd.engine.protocol.EngineBackend``) over vLLM, run in-process.

Loaded only when a service runs with ``--engine vllm`` (the optional extra ``pdd[vllm]``):
``engine`` (``VllmEngine``: the boundary over vLLM's ``LLMEngine``), ``connector``
(``PddConnector``, vLLM's ``KVConnectorBase_V1``: a prefill's KV saved as it is computed, imported
KV loaded into vLLM's paged cache), ``kv_store`` (what the engine and its connector share: KV per
request in the canonical layout, in shared-memory segments, ``kv_segment``, so the workers of a
TP group in other processes reach it), ``paged_kv`` (vLLM's paged layouts — the CPU backend's and
the GPU backends' — ↔ canonical tokens, a TP rank's head slice), ``cache_events`` (vLLM's KV events → PDD's chained block hashes), ``sampling``
(PDD's sampling parameters → vLLM's), ``logits`` (vLLM's logits processor that draws PDD's token
for every request that is not plain greedy) over ``row_sampler`` (one request's draw by (seed,
position), as our engine's, so a handoff keeps seeded output and penalties identical).
"""
