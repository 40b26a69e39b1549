"""The shape of a Llama-family decoder: what every loader produces and the model consumes.

One frozen config covers Llama 2/3, SmolLM2, Mistral (without sliding window) and
Qwen2 (q/k/v biases). ``from_hf_dict`` reads a Hugging Face ``config.json``
(both the transformers-4 ``rope_theta``/``rope_scaling`` form and the
transformers-5 ``rope_parameters`` form); ``to_hf_dict`` writes one that
``transformers`` loads back, which is how the tests build their oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# NOTE: dtypes by name, torch imported only in ``parse_dtype``: the gateway reads a ModelConfig
# (limits, EOS ids) and must start without torch (tests/unit/test_gateway_is_light.py).
_DTYPE_NAMES = ("float32", "bfloat16", "float16")
_SUPPORTED_ROPE = ("default", "linear", "llama3")
_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _dtype_key(name: str | torch.dtype) -> str:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or the torch dtype of one) → its name, checked."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {name!r}")
    return key


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a torch dtype) → torch dtype."""
    import torch

    return getattr(torch, _dtype_key(name))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None or {"rope_type": "linear"|"llama3", "factor": ..., ...} as in transformers
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's ``attention_bias`` sets qkv_bias and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"  # the checkpoint's dtype, the default compute dtype
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        _dtype_key(self.torch_dtype)
        if self.model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type must be one of {_SUPPORTED_MODEL_TYPES}, got {self.model_type!r}"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in _SUPPORTED_ROPE:
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported (only {_SUPPORTED_ROPE})"
                )
            if kind != "default" and float(self.rope_scaling.get("factor", 0)) <= 0:
                raise ValueError(f"rope_scaling factor must be positive, got {self.rope_scaling}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral or Qwen2)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; expected one of {_SUPPORTED_MODEL_TYPES}"
            )
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            raise ValueError("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope and cfg.get("rope_scaling"):
            rope = dict(cfg["rope_scaling"])
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            rope.setdefault(
                "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)
            )
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if kind == "default" else rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that transformers 5 loads as Llama (or Qwen2 when q/k/v have biases)."""
        qwen = self.model_type == "qwen2"
        if qwen and (self.o_bias or self.mlp_bias or not self.qkv_bias):
            raise ValueError("a qwen2 config has q/k/v biases and no o/mlp biases")
        if not qwen and self.qkv_bias != self.o_bias:
            raise ValueError(
                "Llama's attention_bias covers q/k/v/o together; use model_type='qwen2'"
            )
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(
                {k: v for k, v in self.rope_scaling.items() if k not in ("type", "rope_type")}
            )
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if qwen:
            cfg.update(use_sliding_window=False, sliding_window=None)
        else:
            cfg.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        return cfg
