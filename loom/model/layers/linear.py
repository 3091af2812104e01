"""Linear backends: the one interface every projection goes through.

A backend is built once from a float weight [out, in] (already dequantized from the
GGUF blocks) and called on activations [T, in] -> [T, out]. Fused projections (QKV,
gate/up) are one backend over the row-concatenated weights, split by the caller.

Backends are registered by name; the performance work adds quantized ones that read the
GGUF blocks directly and a chooser per shape and batch size.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class LinearBackend(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """y = x @ W^T with W stored densely in `dtype` (float32 by default: the exact mode)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.weight = weight.to(dtype).contiguous()  # [out, in]
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)


LINEAR_BACKENDS: dict[str, Callable[..., LinearBackend]] = {"dense": DenseLinear}


def make_linear(weight: torch.Tensor, backend: str = "dense", **kwargs) -> LinearBackend:
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend '{backend}' (known: {', '.join(LINEAR_BACKENDS)})")
    return LINEAR_BACKENDS[backend](weight, **kwargs)
