"""``Checkpoint``: a loaded model — config, Hugging Face-named tensors, tokenizer — whatever it came from.

Its own module so that every loader (``checkpoint``, ``gguf_checkpoint``,
``tiny``) imports it and none imports another loader for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdd.engine.model_config import ModelConfig, parse_dtype


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[
        str, torch.Tensor
    ]  # Hugging Face names, e.g. "model.layers.0.self_attn.q_proj.weight"
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
