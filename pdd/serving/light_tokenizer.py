"""The model's tokenizer for the gateway: what ``AutoTokenizer`` returns, built without importing torch.

``transformers.AutoTokenizer.from_pretrained`` imports torch although the
tokenizers it returns never use it: picking a class reads the model's config
through ``configuration_utils``, which imports ``modeling_rope_utils`` and so
torch; a GGUF's tokenizer is read with ``integrations/gguf/reader.py``, which
imports torch for the tensors. The tokenizer classes themselves and
transformers' GGUF tokenizer builder do not. So where AutoTokenizer's choice is
certain we make it here and call the chosen class as AutoTokenizer would:

- a GGUF of the ``llama`` architecture with no tokenizer files beside it:
  ``TokenizersBackend`` (transformers maps no tokenizer class to ``llama``),
  its backend built from the metadata by transformers'
  ``convert_gguf_tokenizer``, the metadata read with ``gguf.GGUFReader``
  (``gguf_tokenizer_inputs``, transformers' ``get_gguf_tokenizer`` less the
  reader);
- a Hugging Face directory with ``model_type: llama``, no remote code and a
  ``tokenizer_class`` of none, ``TokenizersBackend``,
  ``PreTrainedTokenizer[Fast]``, ``GPT2Tokenizer[Fast]`` or
  ``LlamaTokenizer[Fast]`` (``TokenizersBackend`` when ``tokenizer.json`` is
  byte-level, as AutoTokenizer decides).

Anything else — Qwen2 or Mistral models (their own classes, mistral-common),
remote code, other classes — goes to AutoTokenizer itself: the same tokenizer,
with torch loaded, and a ``tokenizer_loads_torch`` log line saying why.

NOTE: these are transformers' choices, which an upgrade may move;
tests/unit/test_model_info.py compares every case here with AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

from pdd.engine.model_source import ModelSource

log = structlog.get_logger(__name__)

# A GGUF's neighbours that AutoTokenizer would read too (tokenizer.json, tokenizer_config.json, ...):
# with any of them beside the file, its choice is not the plain GGUF one.
_GGUF_NEIGHBOUR_PREFIXES = (
    "tokenizer",
    "tekken",
    "tiktoken",
    "special_tokens_map",
    "added_tokens",
    "chat_template",
    "additional_chat_templates",
)
# transformers' ``_SPECIAL_TOKENS`` of ``gguf_tokenizer_mapping``: special token → the metadata key of its id.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def load_tokenizer(source: ModelSource, gguf_reader: Any = None) -> Any:
    """``AutoTokenizer.from_pretrained`` of ``source`` (``gguf_reader``: its ``GGUFReader``, if already open)."""
    if source.is_gguf:
        folder, name = source.path.parent, source.path.name
        if gguf_reader is None:
            from gguf import GGUFReader

            gguf_reader = GGUFReader(str(source.path))
        architecture = gguf_reader.fields["general.architecture"].contents()
        if architecture != "llama":
            return _auto_tokenizer(folder, f"GGUF architecture {architecture!r}", gguf_file=name)
        if any(entry.name.startswith(_GGUF_NEIGHBOUR_PREFIXES) for entry in folder.iterdir()):
            return _auto_tokenizer(folder, "tokenizer files beside the GGUF", gguf_file=name)
        return _gguf_tokenizer(folder, name, gguf_reader)
    tokenizer_class, why_not = _hf_tokenizer_class(source.path)
    if tokenizer_class is None:
        return _auto_tokenizer(source.path, why_not)
    return tokenizer_class.from_pretrained(str(source.path), _from_auto=True)


def gguf_tokenizer_inputs(reader: Any) -> tuple[str, dict, dict]:
    """``(architecture, tokenizer_dict, tokenizer_config)`` as transformers' ``get_gguf_tokenizer`` reads them."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    def value(key: str) -> Any:
        return reader.fields[key].contents()

    grouped = {
        group: {
            name: value(f"tokenizer.{key}")
            for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if (
        kind == "llama"
    ):  # NOTE: as transformers: llama.cpp adds BOS to a sentencepiece vocabulary unless told
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":
        config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        id_key = f"tokenizer.ggml.{key}"
        config[name] = tokenizer["tokens"][value(id_key)] if id_key in reader.fields else None
    return value("general.architecture"), tokenizer, config


def _gguf_tokenizer(folder: Path, name: str, reader: Any) -> Any:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, tokenizer_config = gguf_tokenizer_inputs(reader)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    # NOTE: what TokenizersBackend.__init__ does with gguf_file= alone, but with the backend built here
    # (alone it reads the file again, with transformers' reader, which imports torch).
    return TokenizersBackend.from_pretrained(
        str(folder),
        gguf_file=name,
        tokenizer_object=backend,
        _from_auto=True,
        **{**tokenizer_config, **extra},
    )


def _hf_tokenizer_class(path: Path) -> tuple[type | None, str]:
    """The class AutoTokenizer picks for a Hugging Face directory, or (None, why we cannot tell)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    config = json.loads((path / "config.json").read_text())
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if config.get("model_type") != "llama":
        return None, f"model_type {config.get('model_type')!r}"
    if "auto_map" in tokenizer_config or "auto_map" in config:
        return None, "remote code (auto_map)"
    declared = (
        tokenizer_config.get("tokenizer_class")
        or config.get("tokenizer_class")
        or "TokenizersBackend"
    )
    name = declared.removesuffix("Fast")
    if name in ("TokenizersBackend", "PreTrainedTokenizer"):
        return TokenizersBackend, ""
    if name == "GPT2Tokenizer":
        from transformers.models.gpt2.tokenization_gpt2 import GPT2Tokenizer

        return GPT2Tokenizer, ""
    if name == "LlamaTokenizer":
        if TokenizersBackend._tokenizer_json_has_byte_level(str(path)):
            return TokenizersBackend, ""
        from transformers.models.llama.tokenization_llama import LlamaTokenizer

        return LlamaTokenizer, ""
    return None, f"tokenizer_class {declared!r}"


def _auto_tokenizer(folder: Path, why: str, **kwargs: Any) -> Any:
    log.info("tokenizer_loads_torch", path=str(folder), why=why)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), **kwargs)
