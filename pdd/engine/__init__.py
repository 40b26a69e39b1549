"""The inference engine: Llama-family model, paged KV, radix prefix cache, token-budget scheduler.

Modules, one thing each: ``engine`` (the API the services use), ``scheduler``,
``block_manager`` (block tables vs ``block_pool`` + ``radix_cache``),
``model_runner`` (batch → tensors → logits), ``model`` + ``attention`` + ``rope``
(the decoder over paged KV), ``kv_cache`` (the KV tensor), ``kv_wire`` (the KV
transfer format), ``sampling``, ``checkpoint`` / ``gguf_checkpoint`` / ``tiny``
(where weights come from).
"""

from pdd.engine.checkpoint import Checkpoint, build_model, load_checkpoint
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine, StepOutput
from pdd.engine.errors import EngineStalledError, KvCapacityError
from pdd.engine.gguf_checkpoint import load_gguf, smollm2_gguf_path
from pdd.engine.kv_wire import KvDescriptor, KvPayload, from_bytes, to_bytes
from pdd.engine.model_config import ModelConfig
from pdd.engine.sampling import SamplingParams
from pdd.engine.tiny import tiny_model

__all__ = [
    "Checkpoint", "Engine", "EngineConfig", "EngineStalledError", "KvCapacityError", "KvDescriptor",
    "KvPayload", "ModelConfig", "SamplingParams", "StepOutput", "build_model", "from_bytes",
    "load_checkpoint", "load_gguf", "smollm2_gguf_path", "tiny_model", "to_bytes",
]
