"""RMSNorm in float32, as one fused op (bit-identical to x * rsqrt(mean(x^2) + eps) * w)."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D] (or [T, H, Dh] for per-head q/k norms); weight: [D] (or [Dh])
    return F.rms_norm(x, weight.shape, weight, eps)
