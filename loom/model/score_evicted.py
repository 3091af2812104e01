"""Scoring a sequence under KV eviction, for `loom eval --kv-eviction`: the logits the engine's
path would give each token when the request's cache is cut by a policy, over a private cache.

The KV list (slots the attention reads, in order) is cut exactly as the engine cuts a request's
block table: before every chunk, a block-freeing policy (StreamingLLM) frees whole blocks of
`block_size` entries; a selecting policy (SnapKV) observes the last `window` tokens of the
prompt (the first `prompt_len` tokens) in a chunk of their own and keeps its selection for the
rest. Positions are the true ones throughout, as in the engine, and sliding-window layers see
the kept entries within their window's positions (the private cache's slot i holds position i,
so the KV list is also the list of the kept entries' positions).

    streaming  as if token by token: chunks end where the cache is full (`chunk_limit`)
    snapkv     [0, P - w) in chunks, [P - w, P) observed, then P.. over the kept prompt + itself
"""

from __future__ import annotations

from typing import Iterator

import torch

from loom.kv.eviction import EvictionPolicy
from loom.model.kv_cache import kv_keys
from loom.model.kv_dtypes import KVFormat
from loom.model.layers.attention import AttentionMetadata
from loom.model.runner import scoring_sequence


def _observing_cuts(T: int, policy: EvictionPolicy, prompt_len: int, prefill_chunk: int) -> list[int]:
    """Where an observing policy's chunks start (and T): the window [P - w, P) on its own."""
    w = min(policy.params.window, prompt_len)
    cuts = list(range(0, prompt_len - w, prefill_chunk)) + [prompt_len - w] + list(range(prompt_len, T, prefill_chunk))
    return sorted(set(c for c in cuts if c < T)) + [T]


def _chunk_end(a: int, T: int, kv_len: int, policy: EvictionPolicy, cuts: list[int] | None, block_size: int,
               prefill_chunk: int) -> int:
    """The end of the chunk from `a`: the observing policy's next cut, or as far as the policy's
    `chunk_limit` (and `prefill_chunk`) let a block-freeing one go, as the engine's scheduler."""
    if cuts is not None:
        return next(c for c in cuts if c > a)
    limit = policy.chunk_limit(kv_len, block_size)
    return min(T, a + prefill_chunk, a + (limit if limit is not None else T))


@torch.inference_mode()
def score_evicted(model, token_ids, first: int, policy: EvictionPolicy, prompt_len: int,
                  kv_dtype: torch.dtype | KVFormat | None = None, block_size: int = 16,
                  prefill_chunk: int = 512, rows: int = 64) -> Iterator[torch.Tensor]:
    """Log-probabilities [r, V] (float32) of the next token at positions first .. T-2, `rows` at
    a time, in order (as `score_slices`), with `policy` cutting the KV list."""
    ids, kv, slots = scoring_sequence("score_evicted", model, token_ids, first, kv_dtype)
    T = ids.shape[0]
    kept = slots[:0]                                                    # the KV list before the chunk
    observe_end = prompt_len if policy.observes and prompt_len > policy.budget else -1
    cuts = _observing_cuts(T, policy, prompt_len, prefill_chunk) if policy.observes else None
    a = 0
    while a < T:
        b = _chunk_end(a, T, kept.numel(), policy, cuts, block_size, prefill_chunk)
        drop = policy.blocks_to_drop(kept.numel(), b - a, block_size)
        if drop:
            gone = torch.zeros(kept.numel(), dtype=torch.bool)
            for j in drop:
                gone[j * block_size:(j + 1) * block_size] = True
            kept = kept[~gone]
        kv_list = torch.cat([kept, slots[a:b]])
        evicted = kv_list.numel() < b        # slot i holds position i: the list is its positions
        meta = AttentionMetadata.build(slots[a:b], [b - a], [kv_list.numel()], [kv_list],
                                       kv_positions=[kv_list] if evicted else None)
        if b == observe_end:
            meta.observe_rows = torch.arange(b - a)
        hidden = model.forward(ids[a:b], slots[a:b], meta, kv)                      # [b - a, D]
        kept = kv_list
        if b == observe_end:
            keep = policy.select(meta.observed, kv_keys(kv, kv_list, model.cfg.head_dim), model.cfg.attn_scale)
            if keep is not None:
                kept = kv_list[torch.tensor(keep)]
        for r0 in range(max(a, first), min(b, T - 1), rows):
            r1 = min(b, T - 1, r0 + rows)
            yield model.compute_logits(hidden[r0 - a:r1 - a]).float().log_softmax(dim=-1)   # [r1 - r0, V]
        a = b
