"""The KV-cache tensors of a model: one (K, V) pair per layer, `[blocks, kv_heads, block_size,
row]`, a row being one slot's key or value for one kv head in the cache's format
(loom/model/kv_dtypes: head_dim floats, or a quantized row of bytes).

A slot is `block * block_size + offset` in the paged cache (the block ids come from the
KV manager), or simply a position in a private contiguous cache (block_size 1: a cache
`[slots, kv_heads, row]`, as the paged layout is at that size). Within a block
the rows of one kv head are contiguous, so attention reads a sequence's keys of one head in
runs of block_size rows (loom_kernels_kv.h, CacheLayout). `cache_rows` / `store_rows` address
rows by slot whatever the layout. The runner, the scorer and the draft model all allocate
through here; speculative decoding moves accepted draft entries through `move_slots` without
seeing the tensors. Copies move whole rows, so a quantized row (codes and scales) moves as it
is: prefix-cache sharing, copy-on-write forks and rollbacks never requantize.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from loom.model.kv_dtypes import KVFormat, format_of, kv_format


def cache_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at `slots` (any shape S) of a cache [slots, Hkv, row] or [blocks, Hkv,
    block_size, row]: [*S, Hkv, row], a copy."""
    if cache.dim() == 3:
        return cache[slots]
    bs = cache.shape[2]
    return cache[slots // bs, :, slots % bs]


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [len(slots), Hkv, row] written at `slots` [n] of a cache (as in cache_rows)."""
    if cache.dim() == 3:
        cache.index_copy_(0, slots, rows)
    else:
        bs = cache.shape[2]
        cache[slots // bs, :, slots % bs] = rows


_MADV_DONTNEED = 4
_libc = None


def _release_pages(t: torch.Tensor) -> None:
    """madvise(MADV_DONTNEED) over the whole pages inside `t`'s memory (if the call fails, the
    pages stay as they are)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)    # the process's own symbols: the C library's
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE     # pages wholly inside the tensor only:
    last = end // mmap.PAGESIZE * mmap.PAGESIZE            # the heap's neighbours keep theirs
    if last > first:
        _libc.madvise(first, last - first, _MADV_DONTNEED)


def kv_keys(layers: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, head_dim: int):
    """`keys(layer)`: that layer's keys at `slots`, decoded to float32 [len(slots), kv_heads,
    head_dim] whatever the cache's format (what a scoring eviction policy reads)."""
    def keys(layer: int) -> torch.Tensor:
        k = layers[layer][0]
        return format_of(k, head_dim).decode(cache_rows(k, slots))
    return keys


class KVCacheTensors:
    def __init__(self, cfg, num_slots: int, dtype: torch.dtype | KVFormat | str = torch.float32,
                 block_size: int = 1):
        if block_size < 1 or num_slots % block_size:
            raise ValueError(f"{num_slots} slots are no whole number of blocks of {block_size}")
        self.format = kv_format(dtype, head_dim=cfg.head_dim)
        self.block_size = block_size
        # torch.empty: pages are touched only when written, so a large budget costs nothing up front
        row = self.format.row_size(cfg.head_dim)
        shape = ((num_slots, cfg.num_kv_heads, row) if block_size == 1
                 else (num_slots // block_size, cfg.num_kv_heads, block_size, row))
        st = self.format.storage
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=st), torch.empty(shape, dtype=st)) for _ in range(cfg.num_layers)]

    def release(self) -> None:
        """Hands the cache's pages back to the kernel: every entry reads as zero afterwards, and
        a page is allocated again where a request first writes it, as in a cache never used.

        For the speculative cost model's calibration (Engine), whose timed passes attend over
        blocks that nothing wrote: a read of an untouched page maps the kernel's shared zero
        page, and the first write to such a page later copies it and sends the other cores a
        TLB flush (on a VM, interrupts that exit to the host). Left that way, a SmolLM2 engine
        whose cost model had just been timed ran its 8-stream decode steps 1.12x as long as
        one that read its costs from the cache, until requests had written every block the
        passes had read (Spec-Bench's 8-stream `auto` column 0.89x of plain decoding where it
        is 1.00x; docs/benchmarks.md, "A freshly calibrated engine's KV pages"). The engine
        calls it only where passes ran: pages that a freed cache had backed cost nothing to
        write again, and handed back they cost a fault each (an engine whose costs came from the
        cache ran its 8-stream steps ~1% slower for it)."""
        for k, v in self.layers:
            _release_pages(k)
            _release_pages(v)

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype | KVFormat | str = torch.float32) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * kv_format(dtype).row_bytes(cfg.head_dim)

    def copy_blocks(self, copies: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: block `src`'s entries into block `dst`, every layer."""
        if copies and block_size != self.block_size:
            raise ValueError(f"blocks of {block_size} slots in a cache of blocks of {self.block_size}")
        for src, dst in copies:   # a block is one index of the paged layout's first dimension
            for k, v in self.layers:
                k[dst] = k[src]
                v[dst] = v[src]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Entries at slots `src` copied to slots `dst` (same length), every layer."""
        for k, v in self.layers:
            store_rows(k, dst, cache_rows(k, src))
            store_rows(v, dst, cache_rows(v, src))
