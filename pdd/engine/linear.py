"""``Linear``: the projection every layer of the model uses, with an optional oneDNN-prepacked weight.

The weight is stored transposed (``weight_t [in, out]``), the layout ``torch.mm``
(MKL's GEMM) wants. ``pack`` adds a second copy in oneDNN's blocked layout (what vLLM's
CPU backend multiplies by), and every matmul then takes it: measured on this project's
64M-parameter benchmark model's shapes, two threads, on an AMD EPYC (AVX-512) host, oneDNN
runs 440-520 GFLOP/s from 65 to 4,096 rows where MKL's GEMM runs 150-220 (MKL takes a
slower code path on non-Intel CPUs), 1.3-3x faster at 1-8 rows, and 3.3x for the LM head's
single row. That was the engine's whole prefill gap to vLLM (``docs/engine-performance.md``).
The cost is a second copy of every weight; ``weight_t`` serves when packing is unsupported.
Decode-sized inputs go to a third copy in 16-column panels when ``pack_panels`` made one
(``panel_gemm``: oneDNN leaves the cores waiting on the weight stream at those row counts).

NOTE: oneDNN builds (JIT-compiles) and caches one primitive per distinct row count, each
holding ~0.6 MiB; prefill chunks of every length once grew a process's resident memory by
hundreds of MB before that cache reached its 1,024 entries (`pdd bench soak`'s prefill
+14 %). So rows up to ``MAX_EXACT_ROWS`` (decode batches) are multiplied as they come and
taller inputs are padded to a multiple of 64 rows up to 256, of 128 up to ``MAX_CALL_ROWS``,
and cut into slices of that above: at most 81 primitives per weight shape. Padding costs at
most 127 rows' work; slicing would cost a copy of the output (11 % of a prefill, measured).
"""

from __future__ import annotations

import torch
from torch import nn

from pdd.engine import panel_gemm


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

    # NOTE: up to this many rows, one oneDNN primitive per row count (decode batches).
    MAX_EXACT_ROWS = 64
    # NOTE: taller inputs go in slices of this many rows (each padded, see ``padded_rows``).
    MAX_CALL_ROWS = 2048
    # the batch size oneDNN picks its blocked layout for (it serves every other size too)
    PACK_HINT_ROWS = 16

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN-blocked [out, in]; see ``pack``
        self.panels: torch.Tensor | None = None  # [ceil(out / 16), in, 16]; see ``pack_panels``

    @torch.no_grad()
    def pack(self) -> bool:
        """Keep a oneDNN-prepacked copy of the weight (call again after changing it); False if unsupported."""
        if not packing_supported(self.weight_t):
            return False
        weight = self.weight_t.t().contiguous()  # [out, in], the layout oneDNN reorders from
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_HINT_ROWS)
        return True

    @torch.no_grad()
    def pack_panels(self) -> None:
        """Keep a copy of the weight in 16-column panels: decode-sized inputs (up to
        ``MAX_EXACT_ROWS`` rows) then multiply on ``panel_gemm``'s kernel (call again after
        changing the weight)."""
        self.panels = panel_gemm.pack(self.weight_t.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.MAX_EXACT_ROWS:
            bias = None if self.bias is None else self.bias.detach()
            return panel_gemm.linear(x, self.panels, bias, self.weight_t.shape[1])
        if self.packed is None:
            if self.bias is None:
                return torch.mm(x, self.weight_t)
            return torch.addmm(self.bias, x, self.weight_t)
        if x.shape[0] <= self.MAX_CALL_ROWS:
            return self._padded(x)
        return torch.cat([self._padded(part) for part in x.split(self.MAX_CALL_ROWS)])

    @classmethod
    def padded_rows(cls, rows: int) -> int:
        """The row count a ``rows``-row input is multiplied as (one oneDNN primitive each)."""
        if rows <= cls.MAX_EXACT_ROWS:
            return rows
        step = 64 if rows <= 256 else 128
        return -(-rows // step) * step

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = self.padded_rows(rows)
        if padded == rows:
            return self._packed(x)
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))  # [padded, in]
        return self._packed(x)[:rows]

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
