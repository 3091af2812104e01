"""Embedding lookups straight from the stored (possibly quantized) table.

The table stays in the GGUF file's memory map: `embed[ids]` gathers the rows' stored bytes
and dequantizes only those, with the same float32 arithmetic as the `gguf` package's
dequantizers (so the rows are bit-identical to a dequantized copy of the whole table). A
262k x 640 Q8_0 table costs its 178 MB of file pages, touched only where rows are used,
instead of a 671 MB float32 copy.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize


def _q8_0(raw: torch.Tensor, n: int, d: int) -> torch.Tensor:
    b = raw.view(n, d // 32, 34)
    scale = b[..., :2].contiguous().view(torch.float16).float()             # [n, g, 1]
    return (b[..., 2:].contiguous().view(torch.int8).float() * scale).view(n, d)


def _q4_0(raw: torch.Tensor, n: int, d: int) -> torch.Tensor:
    b = raw.view(n, d // 32, 18)
    scale = b[..., :2].contiguous().view(torch.float16).float()             # [n, g, 1]
    qs = b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8) - 8          # elements 0..15, then 16..31
    return (scale * q.float()).view(n, d)


_FAST = {
    QT.F32: lambda raw, n, d: raw.contiguous().view(torch.float32).view(n, d).clone(),
    QT.F16: lambda raw, n, d: raw.contiguous().view(torch.float16).view(n, d).float(),
    QT.BF16: lambda raw, n, d: raw.contiguous().view(torch.bfloat16).view(n, d).float(),
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
}


class QuantEmbedding:
    """`embed[ids]` -> float32 [len(ids), D] from a [V, D] table stored as `qtype` at `offset`."""

    def __init__(self, path: str | os.PathLike, offset: int, qtype: QT, shape: tuple[int, int]):
        v, d = shape
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        # copy-on-write map: a writable array for torch, though nothing ever writes it
        table = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(v, d // block * block_bytes))
        self.rows = torch.from_numpy(table)                                  # [V, row bytes]
        self.qtype, self.shape = qtype, (v, d)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        raw = self.rows[ids.reshape(-1)]                                     # [T, row bytes]
        n, d = raw.shape[0], self.shape[1]
        fast = _FAST.get(self.qtype)
        if fast is not None:
            out = fast(raw, n, d)
        else:
            out = torch.from_numpy(gguf_dequantize(raw.numpy(), self.qtype).reshape(n, d).astype(np.float32))
        return out.view(*ids.shape, d)
