"""The interface of a KV eviction policy.

A sequence that evicts has two lengths: its position (tokens computed, what RoPE sees) and
its KV length (entries in its block table's slot list, what attention reads). A policy works
in KV indices 0 .. kv_len - 1, the order the entries sit in the table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loom.eviction_params import KVEvictionParams


class EvictionPolicy:
    name = ""
    observes = False     # True: scores the prompt at its end from the observation window's queries

    def __init__(self, params: KVEvictionParams):
        self.params = params

    @property
    def budget(self) -> int:
        return self.params.budget

    def blocks_to_drop(self, kv_len: int, num_new: int, block_size: int) -> list[int]:
        """Block-table indices to free before a step that appends `num_new` entries to `kv_len`."""
        return []

    def chunk_limit(self, kv_len: int, block_size: int) -> int | None:
        """The most tokens the next chunk may compute at KV length `kv_len` so that each token
        sees the entries it would see computed one by one (None: no limit). A token's KV then
        never depends on how its prompt was cut into chunks: the step's token budget, a
        prefix-cache hit, the other requests of the batch."""
        return None

    def select(self, observed: list[tuple[torch.Tensor, int | None]], keys: Callable[[int], torch.Tensor],
               scale: float) -> list[int] | None:
        """KV indices to keep (ascending) once the prompt is computed, from each layer's observed
        queries; `keys(layer)` gives that layer's keys along the KV list, [L, kv_heads, D] float32
        (decoded from the cache's format by the caller). None keeps everything. Only policies
        with `observes` are asked."""
        return None
