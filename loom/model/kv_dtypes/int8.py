"""int8 KV cache: each row Hadamard-rotated, then D int8 codes and one float16 scale,
x = d * q with d = max|x| / 127 (D + 2 bytes a row: 1.94x the rows of float16 at D = 64)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.model.kv_dtypes.base import KVFormat, hadamard


@dataclass(frozen=True)
class Int8Rows(KVFormat):
    def row_size(self, head_dim: int) -> int:
        return head_dim + 2

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        y = hadamard(x)                                                   # [..., D]
        d = (y.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
        df = d.float()
        inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
        q = (y * inv).round().clamp(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), d.view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        D = rows.shape[-1] - 2
        d = rows[..., D:].contiguous().view(torch.float16).float()        # [..., 1]
        return hadamard(rows[..., :D].view(torch.int8).float() * d)


INT8 = Int8Rows("int8", 1, torch.uint8, smooth_keys=True)
