"""``Linear``: the projection every layer of the model uses, with an optional oneDNN-prepacked weight.

The weight is stored transposed (``weight_t [in, out]``) and multiplied with
``torch.mm``: on CPU, MKL's GEMM is 1.3-2.5x faster that way than
``F.linear``'s ``x @ W.T`` for decode-sized batches. A tied LM head therefore
keeps its own transposed copy of the embedding.

``pack`` adds a second copy of the weight in oneDNN's blocked layout (what
vLLM's CPU backend does too). Multiplying by it skips the per-call packing that
MKL's GEMM does, which dominates at decode sizes: measured on this project's
64M-parameter benchmark model, one thread, the whole step's GEMMs are 1.2-1.5x
faster for 2-48 rows. For a single row MKL's GEMV is faster still, so one-row
matmuls keep using ``weight_t``. The cost is a second copy of every weight.

NOTE: oneDNN builds (JIT-compiles) and caches one primitive per distinct row count, each holding
a few hundred KiB; prefill chunks of every length made that cache grow a process's resident
memory by hundreds of MB before it reached its 1,024-entry capacity (`pdd bench soak`'s prefill
+14 %). Only decode-sized batches (``MAX_PACKED_ROWS``), where packing pays, take the packed
path, which bounds the cache; prefill-sized matmuls are within a few percent either way.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN prepacking applies to float32 CPU weights when PyTorch was built with it."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear(nn.Module):
    """``x @ W.T + b`` with ``W.T`` stored contiguous as ``weight_t [in, out]``; ``x`` is 2-D."""

    # NOTE: a single row goes to MKL's GEMV on weight_t (faster than oneDNN there).
    MIN_PACKED_ROWS = 2
    # NOTE: above this, MKL's GEMM on weight_t (as fast there); bounds oneDNN's primitive cache.
    MAX_PACKED_ROWS = 64
    # the batch size oneDNN picks its blocked layout for (it serves every other size too)
    PACK_HINT_ROWS = 16

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN-blocked [out, in]; see ``pack``

    @torch.no_grad()
    def pack(self) -> bool:
        """Keep a oneDNN-prepacked copy of the weight (call again after changing it); False if unsupported."""
        if not packing_supported(self.weight_t):
            return False
        weight = self.weight_t.t().contiguous()  # [out, in], the layout oneDNN reorders from
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_HINT_ROWS)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and self.MIN_PACKED_ROWS <= x.shape[0] <= self.MAX_PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)
