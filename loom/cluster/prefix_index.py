"""What each replica has served recently, as chained hashes of the prompt's leading blocks.

A prompt's text is cut into blocks of `block_chars` characters; block i's key hashes block i
together with the key of block i-1, so a key stands for the whole prefix up to its block
(as the engine's own prefix cache keys its KV blocks by token prefix):

    keys(text)   = [h(b0), h(h(b0), b1), h(h(h(b0), b1), b2), ...]     # at most max_blocks
    index[key]   = {replica: last use}            # inverted: who holds this prefix
    lru[replica] = OrderedDict(key -> None)       # per replica, oldest first, capped

`match(keys, candidates)` walks the keys while some candidate still holds them and returns,
per candidate, how many leading blocks it holds: O(blocks x holders), not O(replicas). The
index only sees what the router routed, so it approximates the replicas' caches (a replica's
cache also evicts under memory pressure); `capacity_blocks` bounds it per replica.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

DEFAULT_BLOCK_CHARS = 64
DEFAULT_MAX_BLOCKS = 256              # 16 KiB of leading text per prompt
DEFAULT_CAPACITY_BLOCKS = 65_536      # per replica: 4 MiB of text, ~64 bytes of state per key


def prefix_keys(text: str, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[int]:
    """The chained block keys of the full blocks of `text` (a partial last block has none)."""
    keys: list[int] = []
    parent = b""
    data = text.encode("utf-8", "surrogatepass")
    step = block_chars
    for start in range(0, min(len(data), step * max_blocks) - step + 1, step):
        digest = hashlib.blake2b(parent + data[start:start + step], digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little"))
        parent = digest
    return keys


class PrefixIndex:
    """The inverted index of the module docstring."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, set[Hashable]] = {}
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        """Keys held, over all replicas."""
        return sum(len(lru) for lru in self._lru.values())

    def replicas(self) -> list[Hashable]:
        return list(self._lru)

    def sizes(self) -> dict[Hashable, int]:
        """Replica -> keys it holds."""
        return {r: len(lru) for r, lru in self._lru.items()}

    def insert(self, replica: Hashable, keys: Sequence[int]) -> None:
        """`replica` now holds every prefix in `keys` (most recently used)."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._holders.setdefault(key, set()).add(replica)
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            self._drop_holder(old, replica)

    def remove(self, replica: Hashable) -> None:
        """Forgets a replica (it died or was scaled down)."""
        for key in self._lru.pop(replica, ()):
            self._drop_holder(key, replica)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forgets every replica not in `replicas`."""
        keep = set(replicas)
        for replica in [r for r in self._lru if r not in keep]:
            self.remove(replica)

    def match(self, keys: Sequence[int], candidates: Iterable[Hashable]) -> dict[Hashable, int]:
        """Per candidate, the number of leading `keys` it holds (0 for most)."""
        alive = set(candidates)
        depth = dict.fromkeys(alive, 0)
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for replica in alive:
                depth[replica] = i + 1
        return depth

    def _drop_holder(self, key: int, replica: Hashable) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]
