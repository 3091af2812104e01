"""RMSNorm, computed in float32 whatever the activation dtype (as the reference implementations do)."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D] (or [T, H, Dh] for per-head q/k norms); weight: [D]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)
