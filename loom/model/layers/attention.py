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

After KV eviction a sequence's list holds only the kept entries, in position order, and
`kv_positions[s]` gives each one's position: the window is then applied by position (the
kept entries within W positions of the query, a suffix of its list), not as the last W
entries, which would reach the sinks or the selected old tokens far behind:

    kept entries   0 1 2 3 | 40 41 ... 50 51      window W = 8, query at position 51
    visible                          44 ... 51    (the first visible one found by position)

Paths, chosen per sequence, that compute the same function:
  * decode: sequences with one new token are batched into one SDPA call over keys
    gathered into a padded [S, L, Hkv, D] tensor with a validity mask;
  * rows (loom's kernels): every new token of a sequence (decodes, speculative chains,
    prefill chunks of any length, trees up to 2 * ROW_QUERY_MAX nodes) becomes one row of a
    single kernel call that reads keys and values straight from their cache slots. A
    row's key list is the sequence's earlier context plus the new tokens it may see, in
    position order (for a tree node: its ancestors), so causality, tree masks and the
    sliding window all reduce to "the last keys of the row's list" (after eviction, the
    keys from a first visible one per row, found by position):

        context slots  c0 c1 c2 | n0 n1 n2 n3     tree parents [-1, 0, 0, 2]
        row n3         c0 c1 c2   n0    n2 n3     (3 + depth 3 keys)

  * prefill: every other sequence gets its own SDPA call (plain causal when it has no
    earlier context, no window and no tree mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from loom.model.kv_cache import cache_rows, store_rows
from loom.model.kv_dtypes import format_of

ROW_QUERY_MAX = 32   # rows per kernel group (a group converts its shared keys to float once)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once, shared by every layer."""

    slot_mapping: torch.Tensor          # [T] int64: cache slot each new token's K/V is written to
    query_lens: list[int]               # per sequence
    context_lens: list[int]             # per sequence, including the new tokens
    query_starts: list[int]             # per sequence: offset of its first new token in the batch
    kv_slots: list[torch.Tensor]        # per sequence: [context_len] slot of every context position
    tree_masks: list[torch.Tensor | None] = field(default_factory=list)  # per sequence or empty
    # KV eviction: per sequence, [context_len] position of every entry, or None (entry i at
    # position i); empty when no sequence evicted
    kv_positions: list[torch.Tensor | None] = field(default_factory=list)
    # decode group of the torch path (query_len == 1, no tree mask), built by `_decode_group`
    decode_seqs: list[int] = field(default_factory=list)
    decode_tokens: torch.Tensor | None = None   # [Sd] token index in the batch
    decode_slots: torch.Tensor | None = None    # [Sd, Lmax] padded slots
    decode_key_pos: torch.Tensor | None = None  # [1, Lmax] key indices 0..Lmax-1
    decode_ctx: torch.Tensor | None = None      # [Sd, 1] context lengths
    decode_pos: torch.Tensor | None = None      # [Sd, Lmax] key positions, after eviction only
    decode_q_pos: torch.Tensor | None = None    # [Sd, 1] query positions, after eviction only
    prefill_seqs: list[int] = field(default_factory=list)
    # SnapKV's observation window: batch rows whose (rotated) queries every layer records, in
    # layer order, as (q [R, H, D] float32, the layer's sliding window or None)
    observe_rows: torch.Tensor | None = None
    observed: list[tuple[torch.Tensor, int | None]] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)
    _rows: "KernelRows | None" = None

    @classmethod
    def build(cls, slot_mapping, query_lens, context_lens, kv_slots, tree_masks=None,
              kv_positions=None) -> "AttentionMetadata":
        starts, acc = [], 0
        for q in query_lens:
            starts.append(acc)
            acc += q
        meta = cls(slot_mapping, list(query_lens), list(context_lens), starts, kv_slots,
                   list(tree_masks) if tree_masks else [None] * len(query_lens),
                   list(kv_positions) if kv_positions else [])
        for s, pos in enumerate(meta.kv_positions):
            if pos is not None and meta.tree_masks[s] is not None:
                raise ValueError(f"sequence {s} has both a tree mask and evicted KV entries")
        for s, q in enumerate(query_lens):
            (meta.decode_seqs if q == 1 and meta.tree_masks[s] is None else meta.prefill_seqs).append(s)
        return meta

    def _decode_group(self) -> None:
        """The padded tensors of the torch decode path (built on first use)."""
        if self.decode_slots is not None or not self.decode_seqs:
            return
        lmax = max(self.context_lens[s] for s in self.decode_seqs)
        slots = torch.zeros(len(self.decode_seqs), lmax, dtype=torch.int64)
        for row, s in enumerate(self.decode_seqs):
            slots[row, :self.context_lens[s]] = self.kv_slots[s]
        self.decode_slots = slots
        self.decode_tokens = torch.tensor([self.query_starts[s] for s in self.decode_seqs], dtype=torch.int64)
        self.decode_key_pos = torch.arange(lmax).unsqueeze(0)
        self.decode_ctx = torch.tensor([[self.context_lens[s]] for s in self.decode_seqs], dtype=torch.int64)
        if self.kv_positions:
            pos = self.decode_key_pos.repeat(len(self.decode_seqs), 1)
            for row, s in enumerate(self.decode_seqs):
                if self.kv_positions[s] is not None:
                    pos[row, :self.context_lens[s]] = self.kv_positions[s]
            self.decode_pos = pos
            self.decode_q_pos = pos.gather(1, self.decode_ctx - 1)

    def kernel_rows(self) -> "KernelRows":
        """The row layout of the kernel path (built on first use, shared by every layer)."""
        if self._rows is None:
            self._rows = KernelRows.build(self)
        return self._rows

    def positions_of(self, s: int) -> torch.Tensor | None:
        """[context_len] positions of sequence s's entries, or None when entry i is at position i."""
        return self.kv_positions[s] if self.kv_positions else None

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Sd, 1, 1, Lmax] bool: key is a real context entry (and inside the window by position)."""
        if window not in self._masks:
            m = self.decode_key_pos < self.decode_ctx
            if window and self.decode_pos is not None:
                m &= self.decode_pos > self.decode_q_pos - window
            elif window:
                m &= self.decode_key_pos > self.decode_ctx - 1 - window
            self._masks[window] = m[:, None, None, :]
        return self._masks[window]


@dataclass
class KernelRows:
    """Rows for loom's attention kernel: row r is one new token (batch index tokens[r],
    or r itself when `tokens` is None) with the key slots slots[r, :ctx[r]]."""

    tokens: torch.Tensor | None
    slots: torch.Tensor        # [R, Lmax] int64
    ctx: torch.Tensor          # [R] int64
    rest: list[int]            # sequences left to the prefill path
    groups: torch.Tensor | None = None   # [NG + 1] first row of each sequence's rows
    shared: torch.Tensor | None = None   # [NG] leading slots its rows share (its earlier context)
    seqs: list[int] = field(default_factory=list)       # the sequences whose tokens are the rows, in order
    _first: dict = field(default_factory=dict)          # window -> first visible keys [R]

    def first_keys(self, meta: AttentionMetadata, window: int | None) -> torch.Tensor | None:
        """[R] int64: each row's first visible key under a sliding window applied by position,
        for a batch with evicted entries; None without a window or eviction (the kernel's
        ctx - window is then the same). A row's visible keys are the kept entries with
        position > p - W, a suffix of its list since entries are in position order."""
        if not window or not meta.kv_positions:
            return None
        if window not in self._first:
            parts, r = [], 0
            for s in self.seqs:
                n, c, pos = meta.query_lens[s], meta.context_lens[s], meta.positions_of(s)
                if pos is None:
                    parts.append((self.ctx[r:r + n] - window).clamp(min=0))
                else:
                    parts.append(torch.searchsorted(pos, pos[c - n:] - window, right=True))   # [n]
                r += n
            self._first[window] = torch.cat(parts)
        return self._first[window]

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "KernelRows":
        """Every sequence without a tree mask becomes rows (a long chunk in groups of at most
        ROW_QUERY_MAX rows, each sharing the keys up to its last row's context: no row has keys
        of its own, and the kernel skips what a row cannot see); a tree verification becomes
        rows while it is small, each row's own keys being its ancestors."""
        seqs, rest = [], []
        for s, n in enumerate(meta.query_lens):
            (seqs if meta.tree_masks[s] is None or n <= 2 * ROW_QUERY_MAX else rest).append(s)
        if not seqs:
            return cls(None, torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), rest)
        # numpy row by row (torch ops of a few elements cost several times more), then tensors
        rows = sum(meta.query_lens[s] for s in seqs)
        slots = np.empty((rows, max(meta.context_lens[s] for s in seqs)), dtype=np.int64)
        ctx, tokens, starts, shared, r = [], [], [], [], 0
        for s in seqs:
            n, c, base = meta.query_lens[s], meta.context_lens[s], meta.kv_slots[s].numpy()
            p = c - n                          # context before the new tokens
            mask = meta.tree_masks[s]
            if mask is None:                   # causal: row j reads the first p + j + 1 slots
                for j in range(0, n, ROW_QUERY_MAX):
                    last = min(n, j + ROW_QUERY_MAX)
                    starts.append(r + j)
                    shared.append(p + last)
                    slots[r + j, :c] = base    # the kernel reads a group's shared slots from its first row
                ctx.append(np.arange(p + 1, c + 1, dtype=np.int64))
            else:                              # row j: the context, then its visible new tokens in order
                starts.append(r)
                shared.append(p)
                visible = mask.numpy()
                order = np.argsort(~visible, axis=1, kind="stable")   # each row's visible tokens first, in order
                slots[r:r + n, :p] = base[:p]
                slots[r:r + n, p:c] = base[p:][order]
                ctx.append(p + visible.sum(axis=1))
            tokens.append(np.arange(meta.query_starts[s], meta.query_starts[s] + n, dtype=np.int64))
            r += n
        every = len(seqs) == len(meta.query_lens)
        return cls(None if every else torch.from_numpy(np.concatenate(tokens)), torch.from_numpy(slots),
                   torch.from_numpy(np.concatenate(ctx).astype(np.int64)), rest,
                   torch.tensor(starts + [r], dtype=torch.int64), torch.tensor(shared, dtype=torch.int64), seqs)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # caches: [blocks, Hkv, block_size, row] in their format (loom/model/kv_cache.py); k, v: [T, Hkv, D]
    fmt = format_of(k_cache, k.shape[-1])
    store_rows(k_cache, slot_mapping, fmt.encode(k))
    store_rows(v_cache, slot_mapping, fmt.encode(v))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, stored: bool = False, kern=None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens). Writes k/v to the cache unless `stored`
    (already written), returns [T, H*D]. `kern`: loom's kernels, for the decode group."""
    if not stored:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        _observe(meta, q, window)
    T, H, D = q.shape
    fmt = format_of(k_cache, D)
    if kern is not None:
        rows = meta.kernel_rows()
        out = None if not rows.rest else torch.empty(T, H, D, dtype=q.dtype)
        if rows.ctx.numel():
            qr = q.flatten(1) if rows.tokens is None else q[rows.tokens].flatten(1)    # [R, H*D]
            od = kern.attn_decode(qr.contiguous(), k_cache, v_cache, rows.slots, rows.ctx,
                                  H, k_cache.shape[1], scale, window or 0, rows.groups, rows.shared,
                                  fmt.kernel_id, rows.first_keys(meta, window))
            if out is None:
                return od
            out[rows.tokens] = od.view(-1, H, D)
        _prefill_seqs(out, q, k, v, k_cache, v_cache, meta, rows.rest, scale, window)
        return out.reshape(T, H * D)
    out = None if not meta.prefill_seqs else torch.empty(T, H, D, dtype=q.dtype)
    meta._decode_group()
    if meta.decode_seqs:
        qd = (q if out is None else q[meta.decode_tokens]).unsqueeze(2)   # [Sd, H, 1, D]
        kd = fmt.decode(cache_rows(k_cache, meta.decode_slots)).transpose(1, 2).to(q.dtype)   # [Sd, Hkv, L, D]
        vd = fmt.decode(cache_rows(v_cache, meta.decode_slots)).transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask(window),
                                            scale=scale, enable_gqa=True)  # [Sd, H, 1, D]
        if out is None:
            return od.reshape(T, H * D)
        out[meta.decode_tokens] = od.squeeze(2)
    _prefill_seqs(out, q, k, v, k_cache, v_cache, meta, meta.prefill_seqs, scale, window)
    return out.reshape(T, H * D)


def _prefill_seqs(out, q, k, v, k_cache, v_cache, meta, seqs, scale, window) -> None:
    for s in seqs:
        start, n, ctx = meta.query_starts[s], meta.query_lens[s], meta.context_lens[s]
        out[start:start + n] = _prefill_one(q[start:start + n], k[start:start + n], v[start:start + n],
                                            k_cache, v_cache, meta.kv_slots[s], ctx,
                                            meta.tree_masks[s], scale, window, meta.positions_of(s))


def paged_attention_stored(qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None, kern) -> torch.Tensor:
    """Attention on loom's kernels, for a fused [T, (H + 2 Hkv) * D] projection whose q/k are
    already rotated and whose k/v are already in the cache. Returns [T, H*D]."""
    H, Hkv = num_heads, k_cache.shape[1]
    D = qkv.shape[1] // (H + 2 * Hkv)       # the cache's rows may be quantized: not k_cache.shape[-1]
    if meta.observe_rows is not None:      # a view per layer and step costs more than the check
        _observe(meta, qkv.view(qkv.shape[0], -1, D)[:, :num_heads], window)
    rows = meta.kernel_rows()
    if not rows.rest:   # every token is a row: the kernel reads q straight from the qkv rows
        return kern.attn_decode(qkv, k_cache, v_cache, rows.slots, rows.ctx, H, Hkv, scale, window or 0,
                                rows.groups, rows.shared, format_of(k_cache, D).kernel_id,
                                rows.first_keys(meta, window))
    heads = qkv.view(qkv.shape[0], -1, D)
    return paged_attention(heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:], k_cache, v_cache, meta,
                           scale, window, stored=True, kern=kern)


def _observe(meta: AttentionMetadata, q: torch.Tensor, window: int | None) -> None:
    if meta.observe_rows is not None:
        meta.observed.append((q[meta.observe_rows].float(), window))


def _prefill_one(q, k_new, v_new, k_cache, v_cache, slots, ctx, tree_mask, scale, window, kv_pos=None):
    # q: [n, H, D]; keys: the sequence's whole context [ctx, Hkv, D], at positions kv_pos [ctx]
    # (None: entry i at position i)
    n = q.shape[0]
    fmt = format_of(k_cache, q.shape[-1])
    if kv_pos is None:
        kv_pos = torch.arange(ctx)
        first = 0 if not window else max(0, ctx - n - window + 1)  # oldest key any query can see
    else:   # the first entry within the window of the first query
        first = 0 if not window else int(torch.searchsorted(kv_pos, kv_pos[ctx - n] - window, right=True))
    qh = q.transpose(0, 1).unsqueeze(0)                           # [1, H, n, D]
    if ctx == n and (not window or ctx <= window) and tree_mask is None:
        # keys as the cache holds them, so chunking never changes a result
        kh = fmt.round_trip(k_new).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        vh = fmt.round_trip(v_new).to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    key_slots = slots[first:ctx]
    kh = fmt.decode(cache_rows(k_cache, key_slots)).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, ctx-first, D]
    vh = fmt.decode(cache_rows(v_cache, key_slots)).transpose(0, 1).unsqueeze(0).to(q.dtype)
    q_pos = kv_pos[ctx - n:ctx].unsqueeze(1)                          # [n, 1]
    if tree_mask is not None:  # a tree node's position: the new tokens it sees, after the context
        q_pos = (ctx - n - 1 + tree_mask.sum(dim=1)).unsqueeze(1)
    k_pos = kv_pos[first:ctx].unsqueeze(0)                            # [1, L]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    if tree_mask is not None:
        mask[:, -n:] = tree_mask
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def is_chain(parents) -> bool:
    """Whether draft nodes with these parents form one chain (node i the child of node i - 1),
    which attends as plain causal new tokens do."""
    return all(p == i - 1 for i, p in enumerate(parents))


def tree_attention_mask(num_committed: int, parents) -> torch.Tensor:
    """[n, n] bool mask among a sequence's new tokens: `num_committed` committed tokens
    (causal among themselves) followed by draft nodes; a node sees every committed token,
    its ancestors and itself.

        committed c0 c1 | nodes 0 1 2      (parents [-1, -1, 0])
        c0   1 . | . . .
        c1   1 1 | . . .
        0    1 1 | 1 . .
        1    1 1 | . 1 .
        2    1 1 | 1 . 1

    Built in numpy (a few small slices a node; torch's cost several times more), shared
    with the returned tensor.
    """
    c, d = num_committed, len(parents)
    mask = np.zeros((c + d, c + d), dtype=bool)
    mask[:c, :c] = np.tri(c, dtype=bool)
    mask[c:, :c] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[c + i, c:c + p + 1] = mask[c + p, c:c + p + 1]
        mask[c + i, c + i] = True
    return torch.from_numpy(mask)
