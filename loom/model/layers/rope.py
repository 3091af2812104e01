"""Rotary position embeddings, rotate-half ("NeoX") form, from a precomputed cos/sin table.

llama-architecture GGUF files store Q/K rows permuted for the interleaved form; the loader
undoes that permutation, so every architecture uses this one form:

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
"""

import torch

MIN_TABLE = 4096   # positions in the first table; it doubles as longer contexts arrive


class RotaryEmbedding:
    """`cos`/`sin` [P, Dh] hold positions 0..P-1. P starts small and grows (by doubling, up to
    `max_positions`) through `ensure`: a 32k-context model does not pay for 32k rows of tables
    (128 MB for Gemma 3's two) until a sequence gets that long. A row's values never depend on P."""

    def __init__(self, head_dim: int, base: float, max_positions: int):
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.max_positions = max_positions
        self.cos = self.sin = torch.empty(0, head_dim)
        self.ensure(min(MIN_TABLE, max_positions))

    def ensure(self, n: int) -> None:
        """Tables cover positions below `n` (past `max_positions` only when asked for: a sequence
        that evicts KV may run past the model's context window)."""
        if n <= self.cos.shape[0]:
            return
        # doubling stops at the model's context; past it (a sequence that evicts KV) it doubles on
        cap = self.max_positions if n <= self.max_positions else max(n, 2 * self.cos.shape[0])
        p = min(max(n, 2 * self.cos.shape[0], MIN_TABLE), cap)
        freqs = torch.outer(torch.arange(p, dtype=torch.float32), self.inv_freq)        # [P, Dh/2]
        emb = torch.cat([freqs, freqs], dim=-1)                                          # [P, Dh]
        self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions` [T], shaped [T, 1, Dh] to broadcast over heads."""
        if positions.numel():
            self.ensure(int(positions.max()) + 1)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, Dh]; cos/sin: [T, 1, Dh]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
