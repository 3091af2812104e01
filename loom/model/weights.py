"""Turning GGUF tensors into the weights a model file asks for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loom.errors import ModelLoadError
from loom.loader.gguf import GGUFFile
from loom.model.quant import QuantCodes, exact_codes


@dataclass
class LinearWeight:
    """One [out, in] matrix (possibly several tensors stacked by rows, e.g. fused QKV).

    `dense` is the exact float32 dequantization; `quant` its code form (loom.model.quant),
    exact for the GGUF types that have one, else None; `codes()` then requantizes to 8 bits.
    """

    dense: torch.Tensor
    quant: QuantCodes | None = None

    def codes(self) -> QuantCodes:
        return self.quant if self.quant is not None else QuantCodes.requantize(self.dense)

    @property
    def int4(self) -> QuantCodes | None:
        """The exact 4-bit codes, if the stored type is a 4-bit one."""
        return self.quant if self.quant is not None and self.quant.bits == 4 else None

    def permute_rows(self, order: torch.Tensor) -> "LinearWeight":
        return LinearWeight(self.dense[order].contiguous(), self.quant.permute_rows(order) if self.quant else None)

    @staticmethod
    def cat(parts: list["LinearWeight"]) -> "LinearWeight":
        """Row-stacked (fused QKV, gate/up); parts without an exact form are requantized."""
        dense = torch.cat([p.dense for p in parts])
        if all(p.quant is None for p in parts):
            return LinearWeight(dense)
        return LinearWeight(dense, QuantCodes.cat([p.codes() for p in parts]))


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
        """A projection matrix, with its exact code form when the stored type has one.

        `unpermute_heads`: Q/K of llama-architecture files, whose rows llama.cpp's converter
        interleaved per head for pairwise RoPE; undone here (a pure row reorder) so the
        rotate-half RoPE applies.
        """
        info = self.file.tensor_info(name)
        w = LinearWeight(self.get(name, shape), exact_codes(np.asarray(self.file.raw(name)), info.qtype, shape))
        if unpermute_heads:
            n = shape[0]
            half = n // unpermute_heads // 2
            order = torch.arange(n).view(unpermute_heads, half, 2).transpose(1, 2).reshape(n)
            w = w.permute_rows(order)
        return w
