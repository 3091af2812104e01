"""Repacking GGUF quantized blocks for loom's quantized linear backends.

4-bit GGUF types whose 32-element groups are affine (Q4_0, Q4_1, Q4_K) map exactly onto
torch's int4 group-wise layout, where a weight is `(q - 8) * scale + zero`, q in 0..15:

    Q4_0:  w = d * (q - 8)            -> scale = d,      zero = 0
    Q4_1:  w = d * q + m              -> scale = d,      zero = m + 8 d
    Q4_K:  w = d*sc * q - dmin*mn     -> scale = d*sc,   zero = 8 d*sc - dmin*mn   (per 32-group of a 256 super-block)

Other types (Q5_0, Q8_0, Q6_K, F16, ...) have no exact int4 form; the int8 backend
requantizes them per output channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import Q4_K

GROUP = 32


@dataclass
class Int4Groups:
    """q: [N, K] uint8 in 0..15; scale, zero: [N, K / 32] float32."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def permute_rows(self, order: torch.Tensor) -> "Int4Groups":
        return Int4Groups(self.q[order], self.scale[order], self.zero[order])

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))

    def dequantize(self) -> torch.Tensor:
        g = self.q.shape[1] // GROUP
        w = self.q.float().view(self.q.shape[0], g, GROUP) - 8
        return (w * self.scale[..., None] + self.zero[..., None]).view(self.q.shape)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_groups(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> Int4Groups | None:
    """The exact int4 form of a [N, K] tensor stored as `qtype`, or None if it has none."""
    n, k = shape
    if qtype == QT.Q4_0:
        b = raw.reshape(n, k // 32, 18)
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = _nibbles(b[..., 2:])
        scale, zero = d, np.zeros_like(d)
    elif qtype == QT.Q4_1:
        b = raw.reshape(n, k // 32, 20)
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        q = _nibbles(b[..., 4:])
        scale, zero = d, m + 8 * d
    elif qtype == QT.Q4_K:
        nb = n * (k // 256)
        b = raw.reshape(nb, 144)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)          # [nb, 1]
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)      # [nb, 1]
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])                           # [nb, 8] each
        # 4 chunks of 32 bytes; low nibbles -> sub-block 2j, high nibbles -> sub-block 2j+1
        qs = b[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k // 32, 32)
        scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
        zero = (8 * scale - (dmin * mn.astype(np.float32)).reshape(n, k // 32))
    else:
        return None
    return Int4Groups(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8)),
                      torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                      torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)))
