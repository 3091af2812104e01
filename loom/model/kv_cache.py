"""The KV-cache tensors of a model: one (K, V) pair per layer, `[slots, kv_heads, head_dim]`.

A slot is `block * block_size + offset` in the paged cache (the block ids come from the
KV manager), or simply a position in a private contiguous cache. The runner, the scorer and
the draft model all allocate through here; speculative decoding moves accepted draft
entries through `move_slots` without seeing the tensors.
"""

from __future__ import annotations

import torch


class KVCacheTensors:
    def __init__(self, cfg, num_slots: int, dtype: torch.dtype = torch.float32):
        # torch.empty: pages are touched only when written, so a large budget costs nothing up front
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(cfg.num_layers)]

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype = torch.float32) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

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
