"""Key smoothing for the quantized KV formats: a fixed per-channel factor s (one per layer and
head channel) that divides every key before it is stored and multiplies every query, so
<q * s, k / s> = <q, k> and no byte is added to a row.

Why: a model with per-head q/k norms (Gemma 3) scales a few key channels up for every token
(Gemma 3 270M: up to 62x the median channel RMS) that the query hardly reads.
The Hadamard rotation spreads those channels over the whole row, so every 32-group's scale is
set by them and the small channels the query does read are lost in the rounding. For a
rotated row the rounding error e is close to isotropic, of a size set by |k / s|, so the score
error <q * s, e> has E[<q * s, e>^2] proportional to sum_j q_j^2 s_j^2 * sum_j k_j^2 / s_j^2,
which is smallest (Cauchy-Schwarz) at s_j^2 = |k_j| / |q_j|. The channel sizes are taken from
the norm weights themselves (the normalized head has about unit RMS in every channel), so s
needs no calibration data:

    s_j = sqrt(max(|w_k|_j, eps_k) / max(|w_q|_j, eps_q))   over RoPE pairs (j, j + D/2)

A pair's two channels share one factor, so s commutes with the rotate-half RoPE and the model
folds it into its norm weights: q_norm * s and k_norm / s (loom/model/arch/gemma3.py). Float
caches keep the plain weights.
"""

from __future__ import annotations

import torch

EPS = 1e-2   # a channel's weight floor, relative to the mean of its pairs (dead channels are 0)


def key_smoothing(q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
    """[D] factors s for a layer whose heads are normalized by q_norm / k_norm [D] before RoPE:
    keys are stored as k / s, queries read as q * s. Geometric mean 1; s_j = s_{j + D/2}."""
    half = q_norm.shape[-1] // 2
    pair = lambda w: ((w[:half] ** 2 + w[half:] ** 2) / 2).sqrt()   # noqa: E731  RMS of a RoPE pair
    pk, pq = pair(k_norm.float()), pair(q_norm.float())
    floor = lambda p: p.clamp(min=max(EPS * float(p.mean()), 1e-12))   # noqa: E731
    r = floor(pk) / floor(pq)                                             # [D/2]
    s = r.sqrt()
    s = s / s.log().mean().exp()
    return torch.cat([s, s])
