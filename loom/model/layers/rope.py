"""Rotary position embeddings, rotate-half ("NeoX") form, from a precomputed cos/sin table.

llama-architecture GGUF files store Q/K rows permuted for the interleaved form; the loader
undoes that permutation, so every architecture uses this one form.
"""

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, base: float, max_positions: int):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, Dh/2]
        self.cos = freqs.cos()  # [P, Dh/2]
        self.sin = freqs.sin()
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions` [T], shaped [T, 1, Dh/2] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, Dh]; cos/sin: [T, 1, Dh/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
