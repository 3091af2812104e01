"""A KV cache element format: how one row (a slot's key or value for one kv head, D values)
is stored, as the kernels read it (loom/kernels/csrc/loom_kernels_kv.h) and as the torch path
encodes and decodes it, with the same arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.errors import InvalidRequestError


@dataclass(frozen=True)
class KVFormat:
    name: str
    kernel_id: int          # the kernels' kv_format argument
    storage: torch.dtype    # element type of the cache tensors [..., row_size(D)] (loom/model/kv_cache.py)
    group: int = 16         # head_dim must be a multiple of this
    smooth_keys: bool = False   # models with q/k norms store k / s, read q * s (smoothing.py)

    def row_size(self, head_dim: int) -> int:
        """Elements of `storage` per row."""
        return head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_size(head_dim) * self.storage.itemsize

    def check(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise InvalidRequestError(f"kv_cache_dtype {self.name} needs a head_dim that is a multiple of "
                                      f"{self.group}; this model's is {head_dim}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] float -> [..., row_size(D)] rows of `storage`."""
        return x.to(self.storage)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., row_size(D)] -> [..., D] float32."""
        return rows.float()

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache gives it back."""
        return self.decode(self.encode(x))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Hadamard matrix over blocks of n, the largest power of two
    dividing D; its own inverse. The butterflies of the kernels' `hadamard`, in the same order."""
    D = x.shape[-1]
    n = D & -D
    y = x.float().reshape(-1, D // n, n)
    h = 1
    while h < n:
        y = y.view(y.shape[0], D // n, n // (2 * h), 2, h)
        u, v = y[..., 0, :], y[..., 1, :]
        y = torch.stack([u + v, u - v], dim=-2).view(-1, D // n, n)
        h *= 2
    s = torch.tensor(1.0, dtype=torch.float32) / torch.sqrt(torch.tensor(float(n), dtype=torch.float32))
    return (y * s).view(x.shape)
