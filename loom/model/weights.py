"""Turning GGUF tensors into the torch weights a model file asks for."""

from __future__ import annotations

import numpy as np
import torch

from loom.errors import ModelLoadError
from loom.loader.gguf import GGUFFile


class GGUFWeights:
    """Named float32 weights dequantized from a GGUF file, with llama.cpp's layout quirks undone."""

    def __init__(self, f: GGUFFile):
        self.file = f

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        arr = self.file.dequantize(name)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(self.file.path, f"tensor '{name}' has shape {tuple(arr.shape)}, "
                                                 f"the model config implies {tuple(shape)}")
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))

    def get_unpermuted(self, name: str, n_heads: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Q/K of llama-architecture files: llama.cpp's converter interleaves each head's rows
        for its pairwise RoPE; undo it so rotate-half RoPE applies (rows are independent, so
        this is a pure row reorder)."""
        w = self.get(name, shape)
        half = w.shape[0] // n_heads // 2
        return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
