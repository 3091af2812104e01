"""int4 KV cache: each row Hadamard-rotated, then per 32-group 16 bytes of 4-bit codes and a
float16 scale, x = d * (c - 8), d = (the element of largest magnitude) / -8 (llama.cpp's q4_0
block after the rotation llama.cpp applies too); D/2 + D/16 bytes a row, 3.56x the rows of
float16. Group g's byte j holds element 32g + j (low nibble) and 32g + 16 + j (high)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.model.kv_dtypes.base import KVFormat, hadamard


@dataclass(frozen=True)
class Int4Rows(KVFormat):
    def row_size(self, head_dim: int) -> int:
        return head_dim // 2 + head_dim // 16

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        y = hadamard(x).reshape(*x.shape[:-1], D // 32, 32)
        pick = y.abs().argmax(dim=-1, keepdim=True)                       # first of the largest, as the kernel
        d = (y.gather(-1, pick) / -8.0).to(torch.float16)                 # [..., G, 1]
        df = d.float()
        inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
        c = ((y * inv).round().clamp(-8, 7) + 8).to(torch.uint8)          # [..., G, 32]
        codes = (c[..., :16] | (c[..., 16:] << 4)).reshape(*x.shape[:-1], D // 2)
        return torch.cat([codes, d.reshape(*x.shape[:-1], D // 32).view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        D = rows.shape[-1] * 16 // 9
        b = rows[..., :D // 2].reshape(*rows.shape[:-1], D // 32, 16)
        c = torch.cat([b & 0x0F, b >> 4], dim=-1).float() - 8.0           # [..., G, 32]
        d = rows[..., D // 2:].contiguous().view(torch.float16).float()   # [..., G]
        return hadamard((c * d.unsqueeze(-1)).reshape(*rows.shape[:-1], D))


INT4 = Int4Rows("int4", 2, torch.uint8, group=32, smooth_keys=True)
