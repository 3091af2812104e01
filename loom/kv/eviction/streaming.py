"""StreamingLLM (Xiao et al., 2023): keep the attention sinks and a recent window.

Block-granular: whole blocks between the sinks' blocks and the recent window are freed, oldest
first, as soon as the cache would exceed the budget. The sinks are kept with the rest of their
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
