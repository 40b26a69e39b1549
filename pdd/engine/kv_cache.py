"""The paged KV tensor: one contiguous tensor holding every layer's K and V blocks.

Layout ``[layer, block, offset, kv, head, dim]``: a token's K and V sit side by
side, so one index op per layer writes both and one gathers a sequence's blocks.
A token's *slot* is ``block * block_size + offset``. Block ids come from ``BlockPool``; this module
only stores numbers. One extra block past ``num_blocks`` is a scratch block:
writes that must not land in a shared (radix-cached) block go there, and it is
never handed out.

NOTE: the tensor starts zeroed and only ever receives finite K/V, so padded
reads of unused slots (masked out in attention) can never inject NaN.
"""

from __future__ import annotations

import torch


class KvCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.data = torch.zeros(
            num_layers,
            num_blocks + 1,
            block_size,
            2,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )  # [L, NB+1, bs, 2, KV, D]
        self.scratch_slot = num_blocks * block_size
        # [L, S, 2, KV, D] with S = (NB + 1) * bs: the same storage seen slot by slot
        self._slots = self.data.view(num_layers, -1, 2, num_kv_heads, head_dim)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def layer(self, layer: int) -> torch.Tensor:
        """This layer's blocks, ``[NB+1, bs, 2, KV, D]``."""
        return self.data[layer]

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store one layer's ``kv [N, 2, KV, D]`` at ``slots [N]``."""
        self._slots[layer].index_copy_(0, slots, kv)

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of ``[L * S, 2 * KV * D]`` holding ``slots [n]``, token-major: ``[n * L]``."""
        layer_base = torch.arange(self.num_layers, device=slots.device) * self._slots.shape[1]
        return (slots[:, None] + layer_base[None, :]).reshape(-1)

    def read_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K/V at ``slots [n]`` → ``[L, 2, n, KV, D]`` (the wire layout's shape).

        One gather of whole rows (a token's K and V of one layer are contiguous), token-major:
        the result is the ``[L, 2, n, KV, D]`` view of a contiguous ``[n, L, 2, KV, D]``
        tensor, so the links (token-major) take it without another copy.
        """
        rows = self._slots.view(-1, 2 * self.num_kv_heads * self.head_dim)  # [L * S, 2 * KV * D]
        kv = rows.index_select(0, self._rows(slots))  # [n * L, 2 * KV * D]
        shape = (slots.shape[0], self.num_layers, 2, self.num_kv_heads, self.head_dim)
        return kv.view(shape).permute(1, 2, 0, 3, 4)  # [n, L, 2, KV, D] → [L, 2, n, KV, D]

    def write_tokens(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv [L, 2, n, KV, D]`` (any float dtype, any strides; converted) at ``slots [n]``.

        One scatter of whole rows when ``kv`` is a token-major view (a received region).
        """
        rows = self._slots.view(-1, 2 * self.num_kv_heads * self.head_dim)
        by_token = kv.permute(2, 0, 1, 3, 4).to(self.dtype)  # [n, L, 2, KV, D]
        # NOTE: a view when kv is token-major; a layer-major kv is reordered once here.
        rows.index_copy_(0, self._rows(slots), by_token.reshape(-1, rows.shape[1]))
