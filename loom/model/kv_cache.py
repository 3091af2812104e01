"""The KV-cache tensors of a model: one (K, V) pair per layer, `[slots, kv_heads, row]`, a row
being one slot's key or value for one kv head in the cache's format (loom/model/kv_dtypes:
head_dim floats, or a quantized row of bytes).

A slot is `block * block_size + offset` in the paged cache (the block ids come from the
KV manager), or simply a position in a private contiguous cache. The runner, the scorer and
the draft model all allocate through here; speculative decoding moves accepted draft
entries through `move_slots` without seeing the tensors. Copies move whole rows, so a
quantized row (codes and scales) moves as it is: prefix-cache sharing, copy-on-write forks and
rollbacks never requantize.
"""

from __future__ import annotations

import torch

from loom.model.kv_dtypes import KVFormat, format_of, kv_format


def kv_keys(layers: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, head_dim: int):
    """`keys(layer)`: that layer's keys at `slots`, decoded to float32 [len(slots), kv_heads,
    head_dim] whatever the cache's format (what a scoring eviction policy reads)."""
    def keys(layer: int) -> torch.Tensor:
        k = layers[layer][0]
        return format_of(k, head_dim).decode(k[slots])
    return keys


class KVCacheTensors:
    def __init__(self, cfg, num_slots: int, dtype: torch.dtype | KVFormat | str = torch.float32):
        self.format = kv_format(dtype, head_dim=cfg.head_dim)
        # torch.empty: pages are touched only when written, so a large budget costs nothing up front
        shape = (num_slots, cfg.num_kv_heads, self.format.row_size(cfg.head_dim))
        st = self.format.storage
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=st), torch.empty(shape, dtype=st)) for _ in range(cfg.num_layers)]

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype | KVFormat | str = torch.float32) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * kv_format(dtype).row_bytes(cfg.head_dim)

    def copy_blocks(self, copies: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: block `src`'s entries into block `dst`, every layer."""
        for src, dst in copies:
            a, b = src * block_size, dst * block_size
            for k, v in self.layers:
                k[b:b + block_size] = k[a:a + block_size]
                v[b:b + block_size] = v[a:a + block_size]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Entries at slots `src` copied to slots `dst` (same length), every layer."""
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]
