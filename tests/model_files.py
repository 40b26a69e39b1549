"""Small model files for tests: a GGUF whose metadata holds a sentencepiece tokenizer, and a
Hugging Face directory with a tokenizer.

Real enough for a tokenizer to be loaded two ways and compared: scored pieces, control and
user-defined tokens, BOS/EOS/UNK ids and a chat template; small enough to write per test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# [piece, score, GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined)]
PIECES = [
    ("<unk>", 0.0, 2),
    ("<s>", 0.0, 3),
    ("</s>", 0.0, 3),
    ("\u2581", -1.0, 1),
    ("a", -2.0, 1),
    ("b", -3.0, 1),
    ("c", -4.0, 1),
    ("\u2581a", -5.0, 1),
    ("\u2581b", -6.0, 1),
    ("ab", -7.0, 1),
    ("bc", -8.0, 1),
    ("abc", -9.0, 1),
    ("\u2581ab", -10.0, 1),
    ("<|user|>", 0.0, 4),
    ("<|end|>", 0.0, 3),
]
CHAT_TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"


def write_gguf(path: Path, architecture: str = "llama", context_length: int = 256) -> Path:
    """A GGUF with a model's metadata, a sentencepiece tokenizer and only the embedding tensor."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), architecture)
    w.add_context_length(context_length)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list([p for p, _, _ in PIECES])
    w.add_token_scores([s for _, s, _ in PIECES])
    w.add_token_types([t for _, _, t in PIECES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(PIECES), 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_dir(path: Path, tokenizer=None, tokenizer_class: str | None = "", **tiny) -> Path:
    """``tiny_model(0, **tiny)`` saved as a Hugging Face directory, with ``tokenizer`` saved beside it.

    ``tokenizer_class``: "" keeps what ``save_pretrained`` wrote, None removes the key, anything else
    replaces it (to load the same files as another class); "-" deletes ``tokenizer_config.json``.
    """
    from pdd.engine import Checkpoint, tiny_model

    ckpt = tiny_model(0, **tiny)
    Checkpoint(ckpt.config, ckpt.weights, tokenizer).save_hf(path)
    config_file = path / "tokenizer_config.json"
    if tokenizer is None or tokenizer_class == "":
        return path
    if tokenizer_class == "-":
        config_file.unlink()
        return path
    config = json.loads(config_file.read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    config_file.write_text(json.dumps(config))
    return path
