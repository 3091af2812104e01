"""Turning GGUF tensors into the weights a model file asks for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loom.errors import ModelLoadError
from loom.loader.gguf import GGUFFile
from loom.model.quant import Int4Groups, int4_groups


@dataclass
class LinearWeight:
    """One [out, in] matrix (possibly several tensors stacked by rows, e.g. fused QKV).

    `dense` is the exact float32 dequantization; `int4` its exact 4-bit group form when
    every part is stored in an affine 4-bit GGUF type, else None.
    """

    dense: torch.Tensor
    int4: Int4Groups | None = None

    def permute_rows(self, order: torch.Tensor) -> "LinearWeight":
        return LinearWeight(self.dense[order].contiguous(), self.int4.permute_rows(order) if self.int4 else None)

    @staticmethod
    def cat(parts: list["LinearWeight"]) -> "LinearWeight":
        int4 = Int4Groups.cat([p.int4 for p in parts]) if all(p.int4 is not None for p in parts) else None
        return LinearWeight(torch.cat([p.dense for p in parts]), int4)


class GGUFWeights:
    """Named weights of a GGUF file, with llama.cpp's layout quirks undone."""

    def __init__(self, f: GGUFFile):
        self.file = f

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor dequantized to float32."""
        arr = self.file.dequantize(name)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(self.file.path, f"tensor '{name}' has shape {tuple(arr.shape)}, "
                                                 f"the model config implies {tuple(shape)}")
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))

    def linear(self, name: str, shape: tuple[int, int], unpermute_heads: int | None = None) -> LinearWeight:
        """A projection matrix, with its exact int4 form when the stored type has one.

        `unpermute_heads`: Q/K of llama-architecture files, whose rows llama.cpp's converter
        interleaved per head for pairwise RoPE; undone here (a pure row reorder) so the
        rotate-half RoPE applies.
        """
        info = self.file.tensor_info(name)
        w = LinearWeight(self.get(name, shape), int4_groups(np.asarray(self.file.raw(name)), info.qtype, shape))
        if unpermute_heads:
            n = shape[0]
            half = n // unpermute_heads // 2
            order = torch.arange(n).view(unpermute_heads, half, 2).transpose(1, 2).reshape(n)
            w = w.permute_rows(order)
        return w
