"""A decoder stack's layers in one kernel call, for the batches that allow it.

The fused forward of a model on loom's kernels makes 6-7 kernel calls per layer; around each,
the interpreter, the argument conversion and the output's allocation cost a few microseconds,
~0.4 ms of a 6.5 ms SmolLM2 decode step on Zen 2 (`benchmarks/stack_ab.py`).
`kern.decode_layers` (loom/kernels/csrc/loom_kernels_stack.h) makes the same calls with the
same arguments in the same order from C++, so the hidden states are the same bits. It serves
a batch whose every token is a row of the attention kernel (decode steps, prefill chunks,
draft chains, trees of up to 64 nodes: `AttentionMetadata.kernel_rows` leaves nothing to
torch's attention) and that records no queries for KV eviction (SnapKV's observation
windows); other batches take the model's Python loop.
"""

from __future__ import annotations

import copy

import torch

from loom.model.kv_dtypes import KVFormat


class DecodeStack:
    """The per-model constants of `decode_layers`: every layer's packed projections (qkv, o,
    gate_up, down) and their dims, its norms (`norms(fmt)`: per layer, 2 for llama or 6 for
    Gemma 3, in the kernel's order), its RoPE table's index and its sliding window."""

    def __init__(self, kern, projections: list[list], norms, rope_of: list[int], windows: list[int],
                 down_pre: int, eps: float, num_heads: int, num_kv_heads: int, scale: float):
        self.kern = kern
        packed = self.packed = [lin.p for layer in projections for lin in layer]
        self.dims = [v for p in packed for v in (p.n, p.k, p.bits, int(p.scales16), p.zero)]
        self._norms = norms   # read every step: a layer's norm weights are its attributes'
        self.rope_of, self.windows = rope_of, windows
        self.down_pre, self.eps, self.H, self.Hkv, self.scale = down_pre, eps, num_heads, num_kv_heads, scale
        self.window = max(windows, default=0)   # the windowed layers' window (one size in a model)

    def first(self, n: int) -> "DecodeStack":
        """The stack of the first n layers (a draft model cut from its target)."""
        cut, full, layers = copy.copy(self), self._norms, len(self.rope_of)

        def norms(fmt: KVFormat) -> list[torch.Tensor]:
            flat = full(fmt)
            return flat[:len(flat) // layers * n]

        cut._norms, cut.packed, cut.dims = norms, self.packed[:4 * n], self.dims[:20 * n]
        cut.rope_of, cut.windows = self.rope_of[:n], self.windows[:n]
        return cut

    def weights(self) -> list[torch.Tensor]:
        """The packed matrices as they are now: read at every call, since the packed-weight
        cache moves them once the model is built (a cold load's copies into the buffer a warm
        load reads, loom/model/pack_cache.py)."""
        return [p.w for p in self.packed]

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta, kv_caches,
            tables: list[tuple[torch.Tensor, torch.Tensor]], fmt: KVFormat) -> bool:
        """h [T, D] through every layer in place, where the batch allows (see the module);
        False (h untouched) where it does not. `tables`: the (cos, sin) RoPE tables rope_of indexes."""
        if meta.observe_rows is not None:
            return False
        rows = meta.kernel_rows()
        if rows.rest:
            return False
        self.kern.decode_layers(
            h, self.weights(), self.dims, self._norms(fmt), self.eps, self.down_pre, positions,
            [c for c, _ in tables], [s for _, s in tables], self.rope_of, self.windows,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping, self.H, self.Hkv,
            fmt.kernel_id, self.scale, rows.slots, rows.ctx, rows.groups, rows.shared,
            rows.first_keys(meta, self.window or None))
        return True
