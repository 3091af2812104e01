"""Attention over the paged KV cache for a flat, ragged batch.

The batch holds the new tokens of many sequences back to back. Sequence s contributes
`query_lens[s]` new tokens whose positions end at `context_lens[s] - 1`; its keys are
all `context_lens[s]` positions, read from the cache through its slot list.

    sequence s:  |<------------- context_lens[s] -------------->|
                 | already in cache (computed earlier)| new (q) |
                 0                   context - query_len        context

Query i of sequence s (position p) sees keys at positions k <= p, and with a sliding
window W only keys with k > p - W. An optional per-sequence `tree_mask`
[query_len, query_len] replaces the causal rule among the new tokens (speculative
trees); keys before the new tokens stay visible.

Two paths, chosen per sequence, that compute the same function:
  * decode: sequences with one new token are batched into one SDPA call over keys
    gathered into a padded [S, L, Hkv, D] tensor with a validity mask, or, given loom's
    kernels, one call that reads keys and values straight from their cache slots;
  * prefill: every other sequence gets its own SDPA call (plain causal when it has no
    earlier context, no window and no tree mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once, shared by every layer."""

    slot_mapping: torch.Tensor          # [T] int64: cache slot each new token's K/V is written to
    query_lens: list[int]               # per sequence
    context_lens: list[int]             # per sequence, including the new tokens
    query_starts: list[int]             # per sequence: offset of its first new token in the batch
    kv_slots: list[torch.Tensor]        # per sequence: [context_len] slot of every context position
    tree_masks: list[torch.Tensor | None] = field(default_factory=list)  # per sequence or empty
    # decode group (query_len == 1, no tree mask), precomputed by `finalize`
    decode_seqs: list[int] = field(default_factory=list)
    decode_tokens: torch.Tensor | None = None   # [Sd] token index in the batch
    decode_slots: torch.Tensor | None = None    # [Sd, Lmax] padded slots
    decode_key_pos: torch.Tensor | None = None  # [1, Lmax] key positions 0..Lmax-1
    decode_ctx: torch.Tensor | None = None      # [Sd, 1] context lengths
    prefill_seqs: list[int] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, slot_mapping, query_lens, context_lens, kv_slots, tree_masks=None) -> "AttentionMetadata":
        starts, acc = [], 0
        for q in query_lens:
            starts.append(acc)
            acc += q
        meta = cls(slot_mapping, list(query_lens), list(context_lens), starts, kv_slots,
                   list(tree_masks) if tree_masks else [None] * len(query_lens))
        for s, q in enumerate(query_lens):
            (meta.decode_seqs if q == 1 and meta.tree_masks[s] is None else meta.prefill_seqs).append(s)
        if meta.decode_seqs:
            lmax = max(context_lens[s] for s in meta.decode_seqs)
            slots = torch.zeros(len(meta.decode_seqs), lmax, dtype=torch.int64)
            for row, s in enumerate(meta.decode_seqs):
                slots[row, :context_lens[s]] = kv_slots[s]
            meta.decode_slots = slots
            meta.decode_tokens = torch.tensor([starts[s] for s in meta.decode_seqs], dtype=torch.int64)
            meta.decode_key_pos = torch.arange(lmax).unsqueeze(0)
            meta.decode_ctx = torch.tensor([[context_lens[s]] for s in meta.decode_seqs], dtype=torch.int64)
        return meta

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Sd, 1, 1, Lmax] bool: key is a real context position (and inside the window)."""
        if window not in self._masks:
            m = self.decode_key_pos < self.decode_ctx
            if window:
                m &= self.decode_key_pos > self.decode_ctx - 1 - window
            self._masks[window] = m[:, None, None, :]
        return self._masks[window]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # caches: [num_slots, Hkv, D]; k, v: [T, Hkv, D]
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, stored: bool = False, kern=None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens). Writes k/v to the cache unless `stored`
    (already written), returns [T, H*D]. `kern`: loom's kernels, for the decode group."""
    if not stored:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    T, H, D = q.shape
    out = None if not meta.prefill_seqs else torch.empty(T, H, D, dtype=q.dtype)
    if meta.decode_seqs and kern is not None:
        qd = q.flatten(1) if out is None else q[meta.decode_tokens].flatten(1)     # [Sd, H*D]
        od = kern.attn_decode(qd, k_cache, v_cache, meta.decode_slots, meta.decode_ctx,
                              H, k_cache.shape[1], scale, window or 0)
        if out is None:
            return od
        out[meta.decode_tokens] = od.view(-1, H, D)
    elif meta.decode_seqs:
        qd = (q if out is None else q[meta.decode_tokens]).unsqueeze(2)   # [Sd, H, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2).to(q.dtype)        # [Sd, Hkv, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask(window),
                                            scale=scale, enable_gqa=True)  # [Sd, H, 1, D]
        if out is None:
            return od.reshape(T, H * D)
        out[meta.decode_tokens] = od.squeeze(2)
    for s in meta.prefill_seqs:
        start, n, ctx = meta.query_starts[s], meta.query_lens[s], meta.context_lens[s]
        out[start:start + n] = _prefill_one(q[start:start + n], k[start:start + n], v[start:start + n],
                                            k_cache, v_cache, meta.kv_slots[s], ctx,
                                            meta.tree_masks[s], scale, window)
    return out.reshape(T, H * D)


def paged_attention_stored(qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None, kern) -> torch.Tensor:
    """Attention on loom's kernels, for a fused [T, (H + 2 Hkv) * D] projection whose q/k are
    already rotated and whose k/v are already in the cache. Returns [T, H*D]."""
    if not meta.prefill_seqs:   # all decode: the kernel reads q straight from the qkv rows
        return kern.attn_decode(qkv, k_cache, v_cache, meta.decode_slots, meta.decode_ctx,
                                num_heads, k_cache.shape[1], scale, window or 0)
    H, Hkv, D = num_heads, k_cache.shape[1], k_cache.shape[2]
    heads = qkv.view(qkv.shape[0], -1, D)
    return paged_attention(heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:], k_cache, v_cache, meta,
                           scale, window, stored=True, kern=kern)


def _prefill_one(q, k_new, v_new, k_cache, v_cache, slots, ctx, tree_mask, scale, window):
    # q: [n, H, D]; keys: the sequence's whole context [ctx, Hkv, D]
    n = q.shape[0]
    first = 0 if not window else max(0, ctx - n - window + 1)  # oldest key any query can see
    qh = q.transpose(0, 1).unsqueeze(0)                           # [1, H, n, D]
    if ctx == n and (not window or ctx <= window) and tree_mask is None:
        # keys as the cache holds them, so chunking never changes a result
        kh = k_new.to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        vh = v_new.to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    key_slots = slots[first:ctx]
    kh = k_cache[key_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, ctx-first, D]
    vh = v_cache[key_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
    q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)                   # [n, 1]
    if tree_mask is not None:  # a tree node's position: the new tokens it sees, after the context
        q_pos = (ctx - n - 1 + tree_mask.sum(dim=1)).unsqueeze(1)
    k_pos = torch.arange(first, ctx).unsqueeze(0)                     # [1, L]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    if tree_mask is not None:
        mask[:, -n:] = tree_mask
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
