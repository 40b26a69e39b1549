"""The inference engine: Llama-family model, paged KV, radix prefix cache, token-budget scheduler.

Modules, one thing each: ``engine`` (the API the services use), ``scheduler``,
``block_manager`` (block tables vs ``block_pool`` + ``radix_cache``),
``model_runner`` (batch → tensors → logits), ``model`` + ``attention`` + ``rope``
(the decoder over paged KV), ``kv_cache`` (the KV tensor), ``kv_wire`` (the KV
transfer format), ``sampler`` (a step's logits → tokens, over the pure functions
of ``sampling``), ``checkpoint`` / ``gguf_checkpoint`` / ``tiny``
(where weights come from, as a ``checkpoint_record``), ``model_source`` /
``gguf_metadata`` / ``tiny_config`` (what a model is, read without torch).
"""

from __future__ import annotations

import importlib

# NOTE: resolved on first use (PEP 562), so importing one light submodule (model_source,
# gguf_metadata) does not load torch and the model code.
_EXPORTS = {
    "Checkpoint": "checkpoint_record",
    "build_model": "checkpoint",
    "load_checkpoint": "checkpoint",
    "EngineConfig": "config",
    "Engine": "engine",
    "StepOutput": "engine",
    "EngineStalledError": "errors",
    "KvCapacityError": "errors",
    "load_gguf": "gguf_checkpoint",
    "smollm2_gguf_path": "model_source",
    "KvDescriptor": "kv_wire",
    "KvPayload": "kv_wire",
    "from_bytes": "kv_wire",
    "to_bytes": "kv_wire",
    "ModelConfig": "model_config",
    "SamplingParams": "pdd.core.sampling_params",
    "tiny_model": "tiny",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdd.engine' has no attribute {name!r}")
    return getattr(
        importlib.import_module(module if "." in module else f"pdd.engine.{module}"), name
    )
