"""StreamingLLM (Xiao et al., 2023): keep the attention sinks and a recent window.

Block-granular: whole blocks between the sinks' blocks and the recent window are freed, oldest
first, as soon as the cache would exceed the budget. A prompt is computed as if token by token:
a chunk runs only until the cache is full (`chunk_limit`), so that how a prompt is cut into
chunks changes no token's KV. The sinks are kept with the rest of their
block(s), and a block is freed only when it lies wholly before the last `window` entries, so the
cache holds at most budget + (sink blocks' spare slots) + one block; with the default window
(what the budget leaves after the sinks) it never holds more than the budget once the sink
blocks and one partial block fit.

    kv list     [sink block][b1][b2][b3][b4][b5 partial]     + 1 new token, over budget
    freed            ^^^^ (oldest after the sinks)
"""

from __future__ import annotations

from loom.kv.eviction.base import EvictionPolicy


class StreamingEviction(EvictionPolicy):
    name = "streaming"

    def blocks_to_drop(self, kv_len: int, num_new: int, block_size: int) -> list[int]:
        over = kv_len + num_new - self.budget
        if over <= 0:
            return []
        first = -(-self.params.sinks // block_size)                 # sink blocks are kept whole
        protected = kv_len - (self.params.window or 0)              # entries before the window
        last = min(protected, kv_len) // block_size                 # blocks wholly before both
        candidates = range(first, last)
        return list(candidates[:-(-over // block_size)])

    def chunk_limit(self, kv_len: int, block_size: int) -> int:
        """Token by token, the cache frees blocks only when one more entry would exceed the
        budget: after the drop the first token needs, the chunk may run until the cache is full
        again (at least that one token)."""
        kept = kv_len - len(self.blocks_to_drop(kv_len, 1, block_size)) * block_size
        return max(1, self.budget - kept)
