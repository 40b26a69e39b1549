"""The Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU; optional q/k/v/o biases) over paged KV.

Tokens arrive flattened: ``input_ids [N]`` and ``positions [N]`` for every
sequence of a step, with an ``AttentionMetadata`` saying where each sequence's
K/V lives. q/k/v and gate/up are fused into one matmul each (loaded from the
Hugging Face tensors by ``load_hf_weights``); logits are computed only for the
rows that are sampled. Every projection is a ``linear.Linear`` (weight stored
transposed; oneDNN-prepacked too after ``pack_weights``).

After ``use_fused(True)`` (CPU float32 with the compiled kernels, see ``fused``) the forward
carries the residual stream itself, vLLM-style: each layer's output is added into it and
normalized for the next block in one op, SiLU·mul and RoPE are one op each, and the layers'
modules are called without ``nn.Module.__call__``'s hooks. The arithmetic is the eager
forward's (same adds, same order); only the norm's and SiLU's inner rounding may differ.
A step of decode rows only, every one sampled, with every projection prepacked and the paged
decode kernel on, runs that same fused forward in one compiled call (``decode_forward``,
``csrc/decode_forward.cpp``): the same ops in the same order, so the same logits bit for bit,
without ~140 op calls from Python a step, and the GIL released once for the whole forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdd.engine import fused
from pdd.engine.attention import AttentionMetadata, paged_attention
from pdd.engine.kv_cache import KvCache
from pdd.engine.linear import Linear
from pdd.engine.model_config import ModelConfig
from pdd.engine.rope import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # NOTE: normalise in float32 then cast back before the weight, as transformers' LlamaRMSNorm.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.fused = False  # RoPE as one compiled op (``LlamaModel.use_fused``)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KvCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n, h, kv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x).view(n, h + 2 * kv, self.head_dim)  # [N, H + 2KV, D]
        qk = qkv[:, : h + kv]  # [N, H + KV, D]: q and k, rotated together and in place
        if self.fused:
            fused.rope_(qk, cos, sin)
        else:
            apply_rotary(qk, cos, sin, out=qk)
        new_kv = qkv[:, h:].view(n, 2, kv, self.head_dim)  # [N, 2, KV, D]: a view, no copy
        out = paged_attention(qkv[:, :h], new_kv, cache, self.layer, meta)  # [N, H, D]
        return self.o_proj.forward(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.fused = False
        # (weights, biases, panels) of ``decode_forward`` when it can run (see ``use_fused``)
        self._decode_args: tuple[list, list, list] | None = None

    def use_fused(self, on: bool) -> None:
        """Run the compiled fused ops (``fused``; CPU float32 only) or the eager ones."""
        self.fused = on
        for layer in self.layers:
            layer.self_attn.fused = on
        self._decode_args = self._decode_forward_args() if on else None

    def _decode_forward_args(self) -> tuple[list, list, list] | None:
        """Every layer's weights, biases and panels (``pack_panels``; each None where not made)
        in ``decode_forward``'s order; None unless every projection is prepacked (the op
        multiplies oneDNN-packed weights where it has no panels, and taller inputs)."""
        projections = [m for m in self.modules() if isinstance(m, Linear)]
        if any(p.packed is None for p in projections):
            return None
        weights, biases, panels = [], [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight, attn.qkv_proj.packed, attn.o_proj.packed]
            weights += [layer.post_attention_layernorm.weight]
            weights += [mlp.gate_up_proj.packed, mlp.down_proj.packed]
            biases += [attn.qkv_proj.bias, attn.o_proj.bias]
            biases += [mlp.gate_up_proj.bias, mlp.down_proj.bias]
            panels += [attn.qkv_proj.panels, attn.o_proj.panels]
            panels += [mlp.gate_up_proj.panels, mlp.down_proj.panels]
        panels.append(self.lm_head.panels)
        return weights, biases, panels

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KvCache,
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """``input_ids [N]``, ``cos/sin [N, 1, D]`` (``RotaryTable.lookup``) → logits ``[S, V]`` (float32).

        ``logit_rows [S]``: the rows to turn into logits; None for every row.
        """
        n = input_ids.shape[0]
        if (
            self._decode_args is not None
            and logit_rows is None
            and meta.num_decode == n
            and meta.decode_context_lens is not None
            and n <= Linear.MAX_CALL_ROWS
        ):
            weights, biases, panels = self._decode_args
            if n > Linear.MAX_EXACT_ROWS:
                panels = [None] * len(panels)  # NOTE: as Linear.forward: oneDNN past that
            return torch.ops.pdd.decode_forward(
                input_ids,
                cos,
                sin,
                self.embed_tokens.weight,
                weights,
                biases,
                panels,
                self.norm.weight,
                self.lm_head.packed,
                cache.data,
                meta.slot_mapping,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.config.num_heads,
                Linear.padded_rows(n),
                self.config.rms_norm_eps,
            )  # [N, V]: _forward_fused's logits, in one call
        if self.fused:
            return self._forward_fused(input_ids, cos, sin, cache, meta, logit_rows)
        x = self.embed_tokens(input_ids)  # [N, hidden]
        for layer in self.layers:
            x = layer(x, cos, sin, cache, meta)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)  # [S, hidden]
        x = self.norm(x)
        return self.lm_head(x).float()

    def _forward_fused(self, input_ids, cos, sin, cache, meta, logit_rows) -> torch.Tensor:
        """``forward`` on the fused ops: the residual stream is updated in place."""
        layers, eps = self.layers, self.config.rms_norm_eps
        residual = self.embed_tokens(input_ids)  # [N, hidden]: a fresh tensor, ours to update
        x = fused.rms_norm(residual, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = fused.add_rms_norm_(
                residual,
                attn.forward(x, cos, sin, cache, meta),
                layer.post_attention_layernorm.weight,
                eps,
            )
            # the next block's norm: the next layer's input norm, or the model's final one
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x = fused.add_rms_norm_(
                residual,
                mlp.down_proj.forward(fused.silu_mul(mlp.gate_up_proj.forward(x))),
                norm.weight,
                eps,
            )  # [N, hidden]
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)  # [S, hidden]
        return self.lm_head.forward(x).float()

    def pack_panels(self) -> None:
        """Keep every projection in 16-column panels for decode-sized inputs (``panel_gemm``)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack_panels()
        self.use_fused(self.fused)  # NOTE: decode_forward holds the panels: renew them

    def pack_weights(self) -> bool:
        """Prepack every projection for oneDNN (CPU float32; see ``linear``); False if unsupported."""
        packed = all([m.pack() for m in self.modules() if isinstance(m, Linear)])
        self.use_fused(self.fused)  # NOTE: decode_forward holds the packed weights: renew them
        return packed

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        cfg, done = self.config, set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            done.add(name)
            return weights[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if param.dim() == 2 and param is not self.embed_tokens.weight:
                value = value.t()  # Linear.weight_t is [in, out]
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"{name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}"
                )
            param.copy_(value)

        put(self.embed_tokens.weight, take("model.embed_tokens.weight"), "embed_tokens")
        put(self.norm.weight, take("model.norm.weight"), "norm")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        put(self.lm_head.weight_t, take(head), "lm_head")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [take(f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
            put(attn.qkv_proj.weight_t, torch.cat(qkv), p + "qkv")
            if cfg.qkv_bias:
                qkv_bias = [take(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]
                put(attn.qkv_proj.bias, torch.cat(qkv_bias), p + "qkv.bias")
            put(attn.o_proj.weight_t, take(p + "self_attn.o_proj.weight"), p + "o_proj")
            if cfg.o_bias:
                put(attn.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "o_proj.bias")
            gate_up = [take(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
            put(mlp.gate_up_proj.weight_t, torch.cat(gate_up), p + "gate_up")
            put(mlp.down_proj.weight_t, take(p + "mlp.down_proj.weight"), p + "down_proj")
            if cfg.mlp_bias:
                put(
                    mlp.gate_up_proj.bias,
                    torch.cat([take(f"{p}mlp.{x}_proj.bias") for x in ("gate", "up")]),
                    p + "gate_up.bias",
                )
                put(mlp.down_proj.bias, take(p + "mlp.down_proj.bias"), p + "down_proj.bias")
            put(
                layer.input_layernorm.weight,
                take(p + "input_layernorm.weight"),
                p + "input_layernorm",
            )
            put(
                layer.post_attention_layernorm.weight,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )
        unused = set(weights) - done - {"lm_head.weight"}
        unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
        if unused:
            raise ValueError(f"checkpoint has unexpected tensors: {sorted(unused)[:5]}")
