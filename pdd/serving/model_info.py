"""What the gateway needs of the model: its limits and tokenizer, not its weights.

Read per spec kind without torch (tests/unit/test_gateway_is_light.py):
``tiny:...`` → ``tiny_config`` (no tokenizer); a ``.gguf`` or ``smollm2`` → its
metadata (``gguf_metadata``) and tokenizer (``light_tokenizer``); a Hugging Face
directory → its ``config.json`` and tokenizer files. Each value equals what
``load_model(spec)`` gives the engines (tests/unit/test_model_info.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gguf import GGUFReader

from pdd.core.model_info import ModelInfo
from pdd.engine.gguf_metadata import gguf_config
from pdd.engine.model_config import ModelConfig
from pdd.engine.model_source import resolve_model_source
from pdd.engine.tiny_config import tiny_config
from pdd.serving.light_tokenizer import load_tokenizer
from pdd.serving.model_spec import tiny_kwargs

Decode = Callable[[Sequence[int]], str] | None


def _config_and_tokenizer(spec: str) -> tuple[ModelConfig, object | None]:
    if spec.startswith("tiny:"):
        shape = tiny_kwargs(spec)
        del shape["seed"]  # the weights', not the shape's
        return tiny_config(**shape), None
    source = resolve_model_source(spec)
    if source.is_gguf:
        # NOTE: read the metadata only; dequantizing weights the gateway never uses costs seconds.
        reader = GGUFReader(str(source.path))
        return gguf_config(reader), load_tokenizer(source, reader)
    config = source.hf_config()
    source.safetensors_files()  # NOTE: a directory the engines cannot load is refused here as there
    return config, load_tokenizer(source) if source.has_tokenizer else None


def load_model_info(spec: str) -> tuple[ModelInfo, Decode]:
    config, tok = _config_and_tokenizer(spec)
    encode = decode = None
    template = ""
    if tok is not None:
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
        template = getattr(tok, "chat_template", None) or ""
    info = ModelInfo(
        name=spec,
        vocab_size=config.vocab_size,
        max_context_tokens=config.max_position_embeddings,
        eos_token_ids=tuple(config.eos_token_ids),
        chat_template=template,
        encode=encode,
        kv_values_per_token=kv_values_per_token(config),
        kv_value_bytes=_ITEMSIZE.get(config.torch_dtype, 4),
    )
    return info, decode


# NOTE: by name: the gateway never loads torch (pdd.engine.model_config names its dtypes too).
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_values_per_token(config: ModelConfig) -> int:
    """KV values one token holds: layers × kv heads × head dim × 2 (K and V)."""
    return config.num_layers * config.num_kv_heads * config.head_dim * 2
