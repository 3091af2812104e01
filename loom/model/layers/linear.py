"""Linear backends: the one interface every projection goes through.

A backend is built once from a `LinearWeight` and called on activations [M, in] ->
[M, out] (float32 in, float32 out). Fused projections (QKV, gate/up) are one backend over
row-stacked weights, split by the caller.

    exact     dense float32 (MKL): the reference mode, bit-identical to transformers
    bf16      dense bfloat16 (oneDNN): compute-bound shapes, on CPUs with native bf16
    int4      torch's group-wise int4 kernel over the GGUF 4-bit blocks, repacked exactly
    int8      per-output-channel int8 requantization, for types with no exact int4 form
    auto      int4/int8 while M is small (memory-bound); above a threshold a dense GEMM,
              bf16 where the CPU has bf16 dot products (AVX512-BF16/AMX), else float32

Backends are registered by name in LINEAR_MODES; `make_linear(weight, mode)` builds one.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from loom.model.cpu import has_native_bf16
from loom.model.quant import GROUP, Int4Groups
from loom.model.weights import LinearWeight

# Rows (tokens) above which the dense bf16 GEMM beats the weight-only kernels on this
# class of CPU (AVX-512 BF16); measured with `loom bench` / benchmarks/linear_crossover.py.
AUTO_MAX_SMALL_M = 16


class LinearBackend(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """y = x @ W^T with W stored densely in `dtype`."""

    def __init__(self, weight: LinearWeight | torch.Tensor, dtype: torch.dtype = torch.float32):
        w = weight.dense if isinstance(weight, LinearWeight) else weight
        self.weight = w.to(dtype).contiguous()  # [out, in]
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).float()


class Int4Linear:
    """Group-wise (32) int4 weights: w = (q - 8) * scale + zero, float32 activations."""

    def __init__(self, groups: Int4Groups):
        n, k = groups.q.shape
        self.out_features, self.in_features = n, k
        self.packed = torch._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([groups.scale.t(), groups.zero.t()], dim=-1).contiguous()  # [K/32, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


class Int8Linear:
    """Per-output-channel int8 weights (w ~ q * scale), float32 activations."""

    def __init__(self, weight: LinearWeight | torch.Tensor):
        w = weight.dense if isinstance(weight, LinearWeight) else weight
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.float()
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scale)


class AdaptiveLinear:
    """Weight-only quantized kernel for small M (bandwidth-bound), dense bf16 above."""

    def __init__(self, weight: LinearWeight, max_small_m: int = AUTO_MAX_SMALL_M):
        self.small = Int4Linear(weight.int4) if weight.int4 is not None else Int8Linear(weight)
        self.large = DenseLinear(weight, torch.bfloat16 if has_native_bf16() else torch.float32)
        self.max_small_m = max_small_m
        self.out_features, self.in_features = self.large.out_features, self.large.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= self.max_small_m else self.large(x)


LINEAR_MODES: dict[str, Callable[[LinearWeight], LinearBackend]] = {
    "exact": lambda w: DenseLinear(w, torch.float32),
    "bf16": lambda w: DenseLinear(w, torch.bfloat16),
    "int4": lambda w: Int4Linear(w.int4) if w.int4 is not None else Int8Linear(w),
    "int8": Int8Linear,
    "auto": AdaptiveLinear,
}


def make_linear(weight: LinearWeight | torch.Tensor, mode: str = "exact") -> LinearBackend:
    if mode not in LINEAR_MODES:
        raise ValueError(f"unknown linear mode '{mode}' (known: {', '.join(LINEAR_MODES)})")
    if isinstance(weight, torch.Tensor):
        weight = LinearWeight(weight)
    return LINEAR_MODES[mode](weight)
