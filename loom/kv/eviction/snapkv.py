"""SnapKV (Li et al., 2024): keep the prompt entries the last prompt tokens attend to.

When the prompt is computed, each earlier entry gets a score: the softmax attention the
`window` last prompt tokens (the observation window) pay it, summed over those queries, all
heads and all layers (a sliding-window layer only over the keys its window lets it see), then
smoothed by an average pool of width `pool`, so neighbours of a hit come along. The first
`sinks` entries, the `budget - sinks - window` best-scored others and the window are kept.

loom's attention kernel returns no weights, so the scores are computed here in torch from the
queries the layers recorded (AttentionMetadata.observe_rows) and the cached keys (float16 with
the kernels). One selection serves every layer: the block table is shared by all layers, and
the kept entries are packed into fresh blocks (KVCacheManager.compact), freeing the rest.
Generated tokens are then appended and kept, as in the paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.kv.eviction.base import EvictionPolicy


class SnapKVEviction(EvictionPolicy):
    name = "snapkv"
    observes = True

    def select(self, observed, keys, scale):
        L, w = keys(0).shape[0], observed[0][0].shape[0] if observed else 0
        if L <= self.budget or w == 0:
            return None
        prefix = L - w                                      # entries that may be evicted (and sinks)
        scores = torch.zeros(prefix)
        for layer, (q, window) in enumerate(observed):
            scores += _window_attention(q, keys(layer), prefix, window, scale)
        sinks = min(self.params.sinks, prefix)
        pool = self.params.pool
        if pool > 1:
            scores = F.avg_pool1d(scores[None, None], pool, stride=1, padding=pool // 2,
                                  count_include_pad=False)[0, 0]
        k = min(max(self.budget - sinks - w, 0), prefix - sinks)
        best = (scores[sinks:].topk(k).indices + sinks).tolist() if k else []
        return sorted(list(range(sinks)) + best + list(range(prefix, L)))


def _window_attention(q: torch.Tensor, keys: torch.Tensor, prefix: int, window: int | None,
                      scale: float) -> torch.Tensor:
    """q [w, H, D] at KV indices prefix..prefix+w-1, keys [L, Hkv, D] -> [prefix]: the attention
    each of the first `prefix` keys gets, summed over queries and heads (causal, windowed)."""
    w, H, D = q.shape
    L, Hkv = keys.shape[0], keys.shape[1]
    logits = torch.einsum("wkgd,lkd->kgwl", q.view(w, Hkv, H // Hkv, D), keys) * scale    # [Hkv, G, w, L]
    q_idx = torch.arange(prefix, prefix + w)[:, None]                                     # [w, 1]
    k_idx = torch.arange(L)[None, :]                                                      # [1, L]
    hidden = k_idx > q_idx
    if window:
        hidden |= k_idx <= q_idx - window
    logits.masked_fill_(hidden, float("-inf"))
    return logits.softmax(dim=-1)[..., :prefix].sum(dim=(0, 1, 2))
