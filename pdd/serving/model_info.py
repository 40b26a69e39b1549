"""What the gateway needs of the model: its limits and tokenizer, not its weights."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from pdd.convert.gateway import ModelInfo
from pdd.engine.model_config import ModelConfig
from pdd.serving.model_spec import load_model

Decode = Callable[[Sequence[int]], str] | None


def _config_and_tokenizer(spec: str) -> tuple[ModelConfig, object | None]:
    path = None
    if spec == "smollm2":
        from pdd.engine.gguf_checkpoint import smollm2_gguf_path

        path = smollm2_gguf_path()
    elif spec.endswith(".gguf"):
        path = Path(spec)
    if path is not None:
        # NOTE: read the metadata only; dequantizing weights the gateway never uses costs seconds.
        from gguf import GGUFReader
        from transformers import AutoTokenizer

        from pdd.engine.gguf_checkpoint import gguf_config

        return gguf_config(GGUFReader(str(path))), AutoTokenizer.from_pretrained(str(path.parent),
                                                                                 gguf_file=path.name)
    ckpt = load_model(spec)
    return ckpt.config, ckpt.tokenizer


def load_model_info(spec: str) -> tuple[ModelInfo, Decode]:
    config, tok = _config_and_tokenizer(spec)
    encode = decode = None
    template = ""
    if tok is not None:
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
        template = getattr(tok, "chat_template", None) or ""
    info = ModelInfo(name=spec, vocab_size=config.vocab_size, max_context_tokens=config.max_position_embeddings,
                     eos_token_ids=tuple(config.eos_token_ids), chat_template=template, encode=encode)
    return info, decode
