"""Rotary position embeddings, rotate-half ("NeoX") form, from a precomputed cos/sin table.

llama-architecture GGUF files store Q/K rows permuted for the interleaved form; the loader
undoes that permutation, so every architecture uses this one form:

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
"""

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, base: float, max_positions: int):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, Dh/2]
        emb = torch.cat([freqs, freqs], dim=-1)                                          # [P, Dh]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions` [T], shaped [T, 1, Dh] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, Dh]; cos/sin: [T, 1, Dh]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
